"""A volunteer with one fault, hivemind-style: a subclass of the real `Volunteer` that the integration tests start
in place of `asyncrl-client join`, so the shipping volunteer carries no test hooks.

    python -m tests.fault_volunteer slow-prompt:3 join ADDRESS --name slow ...   (tests/harness.py `fault=`)

  slow-prompt:S    S seconds more per leased prompt, before the engine call (a slow GPU, in proportion to the work:
                   test_sized_leases, test_capacity, test_long_work)
  slow-generate:S  S seconds more per work, whatever its size (an honest but slow GPU: test_long_work)
  hold-uploads     keeps working and spooling, uploads nothing while <data_dir>/HOLD_UPLOADS exists (test_outage,
                   test_client_crash, test_lease_expiry)
"""

from __future__ import annotations

import sys
import time

from asyncrl.client import cli, worker


class SlowPromptVolunteer(worker.Volunteer):
    seconds = 0.0

    def _generate(self, leases, group_size, sampling):
        time.sleep(self.seconds * len(leases))  # like a real engine: not cut short by Ctrl-C
        return super()._generate(leases, group_size, sampling)


class SlowGenerateVolunteer(worker.Volunteer):
    seconds = 0.0

    def _generate_work(self, work):
        self.stop.wait(self.seconds)
        return super()._generate_work(work)


class HeldUploadsVolunteer(worker.Volunteer):
    def _upload(self, batch_id, payload):
        if (self.cfg.data_dir / "HOLD_UPLOADS").exists():
            return False  # stop this flush, as a busy coordinator would; the batch stays spooled
        return super()._upload(batch_id, payload)


def volunteer_class(fault: str) -> type[worker.Volunteer]:
    name, _, arg = fault.partition(":")
    if name == "hold-uploads" and not arg:
        return HeldUploadsVolunteer
    kinds = {"slow-prompt": SlowPromptVolunteer, "slow-generate": SlowGenerateVolunteer}
    if name not in kinds or not arg:
        raise SystemExit(f"unknown fault {fault!r}: slow-prompt:S, slow-generate:S or hold-uploads")
    return type(kinds[name].__name__, (kinds[name],), {"seconds": float(arg)})


def main(argv: list[str]) -> int:
    worker.Volunteer = volunteer_class(argv[0])  # what the real CLI builds from here on
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
