"""The checks `join` and `doctor` share: each returns a `Check` row (stable id, status, detail, fix).

`join` runs the cheap ones before it loads anything (TCP reach, the handshake with the version gate, the
run's state and the clock offset) and stops at the first failure, pointing to `doctor`; `doctor`
(client/doctor.py) runs all of them and prints the table. Statuses: pass · warn (join works, but see
the fix) · fail (join would not work) · skip (not checked: an earlier row failed).

Clock: the offset is measured against the coordinator's clock in its handshake answer, at the midpoint
of the round trip, using the clock our envelopes are stamped with (`envelope.clock()`, which tests skew
with ASYNCRL_TEST_CLOCK_SKEW_S). Beyond the envelope window (±300 s by default) every batch would be
refused EXPIRED; beyond DHT_CLOCK_TOLERANCE_S hivemind's DHT expirations run early or late.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from asyncrl.protocol import envelope, handshake
from asyncrl.protocol.errors import ProtocolError, RejectCode

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
DHT_CLOCK_TOLERANCE_S = 3.0
INFO_TIMEOUT_S = 15.0
DOCTOR_HINT = "run `asyncrl-client doctor` with the same address and flags for a full diagnosis"


@dataclass
class Check:
    id: str
    status: str
    detail: str
    fix: str = ""
    code: str = ""  # a RejectCode value where one explains the failure (tests assert on it)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Handshake:
    info: handshake.CoordinatorInfo
    offset_s: float  # coordinator clock - our (envelope) clock
    rtt_s: float


def tcp_check(addr) -> Check:
    from asyncrl.swarm.transport import TransportError, check_reachable

    if addr.host is None or addr.port is None:
        return Check("tcp", PASS, f"{addr.maddr}: not a TCP address, left to libp2p")
    try:
        check_reachable(addr)
    except TransportError as exc:
        return Check("tcp", FAIL, str(exc), f"check that the coordinator runs and that {addr.host}:{addr.port} is "
                                            "its --port (not the dashboard's), open in its firewall and forwarded "
                                            "on its router; copy the address the coordinator printed")
    return Check("tcp", PASS, f"{addr.host}:{addr.port} accepts TCP connections")


def exchange(node, coordinator_peer_id: str, *, dial_back_ports: tuple[int, ...] = (),
             timeout: float = INFO_TIMEOUT_S, missing_rewards: tuple[str, ...] = ()) -> Handshake:
    """One InfoRequest -> CoordinatorInfo round trip (TransportError / ProtocolError on failure).
    `missing_rewards`: tell the coordinator which of its reward packages we lack (its answer refuses us)."""
    from asyncrl.swarm import streams

    request = handshake.InfoRequest(client_version=handshake.package_version(),
                                    dial_back_ports=tuple(dial_back_ports)[:handshake.MAX_DIAL_BACK_PORTS],
                                    missing_rewards=tuple(n[:64] for n in missing_rewards)[:handshake.MAX_MISSING_REWARDS])
    t0 = envelope.clock()
    try:
        raw = node.call(coordinator_peer_id, streams.INFO, handshake.encode(request),
                        max_response_bytes=handshake.MAX_INFO_BYTES, timeout=timeout)
    except ProtocolError as exc:
        if exc.code is RejectCode.PAYLOAD_TOO_LARGE:  # asyncrl 0.1 reads at most 64 bytes here
            raise ProtocolError(RejectCode.UNSUPPORTED_VERSION, "the coordinator runs asyncrl 0.1 (schema 1): "
                                + handshake.upgrade_hint("coordinator", "0.1.0")) from None
        raise
    t1 = envelope.clock()
    info = handshake.decode_info(raw)
    return Handshake(info, info.time - (t0 + t1) / 2, t1 - t0)


def version_check(hs: Handshake | None, *, local: str) -> Check:
    if hs is None:
        return Check("versions", SKIP, f"{local}; the coordinator's versions are unknown (it was not reached)")
    info = hs.info
    theirs = f"coordinator asyncrl {info.asyncrl_version} (protocol {info.protocol}, schema {info.schema})"
    refusal = handshake.coordinator_refusal(info, client_version=handshake.package_version())
    if refusal is not None:
        return Check("versions", FAIL, f"{refusal[0].value}: {local}; {theirs}", refusal[1], code=refusal[0].value)
    return Check("versions", PASS, f"{local}; {theirs}")


def missing_reward_packages(info: handshake.CoordinatorInfo) -> list[handshake.RewardPackage]:
    """The run's reward packages this installation lacks, or has at another version (by entry point)."""
    from asyncrl.tasks.rewards import reward_package

    return [p for p in info.reward_packages if reward_package(p.reward) != (p.package, p.version)]


def reward_packages_check(hs: Handshake) -> Check:
    """Every package the run's rewards come from, installed at the run's version: otherwise each leased
    group would fail to score (UnknownReward) or score differently (REWARD_MISMATCH)."""
    from asyncrl.tasks.rewards import reward_package

    missing = missing_reward_packages(hs.info)
    if not missing:
        names = ", ".join(f"{p.package} {p.version}" for p in hs.info.reward_packages)
        return Check("rewards", PASS, f"reward packages: {names}" if names else "only built-in rewards")
    have = []
    for name, version in handshake.package_versions(missing):
        rewards = [p.reward for p in missing if (p.package, p.version) == (name, version)]
        mine = {reward_package(r) for r in rewards} - {None}
        here = ", ".join(f"{d} {v}" for d, v in sorted(mine)) or "not installed"
        have.append(f"rewards {', '.join(rewards)} from {name} {version} (this machine: {here})")
    return Check("rewards", FAIL, "this run scores with " + "; ".join(have), handshake.install_line(missing),
                 code=RejectCode.REWARD_PACKAGE_MISSING.value)


def run_state_check(hs: Handshake) -> Check | None:
    if hs.info.finished:
        return Check("run", FAIL, f"run {hs.info.run_id!r} has finished", "nothing to do until the operator starts "
                                  "another run; `join --follow` waits for it")
    return None


def clock_check(hs: Handshake | None) -> Check:
    if hs is None:
        return Check("clock", SKIP, "the coordinator was not reached")
    off, window = hs.offset_s, hs.info.window_s
    detail = f"this machine's clock is {-off:+.1f} s from the coordinator's (round trip {hs.rtt_s * 1000:.0f} ms)"
    fix = "synchronise the clock (e.g. `timedatectl set-ntp true`, or enable automatic time in your OS settings)"
    if abs(off) > window:
        return Check("clock", FAIL, f"{detail}: beyond the ±{window:.0f} s envelope window, every batch would be "
                                    "refused EXPIRED", fix, code="EXPIRED")
    if abs(off) > DHT_CLOCK_TOLERANCE_S:
        return Check("clock", WARN, f"{detail}: beyond the DHT's {DHT_CLOCK_TOLERANCE_S:.0f} s tolerance", fix)
    return Check("clock", PASS, detail)


def local_versions() -> str:
    import platform

    return (f"python {platform.python_version()}, asyncrl {handshake.package_version()} "
            f"(protocol {handshake.PROTOCOL_VERSION}, schema {handshake.SCHEMA_VERSION})")


def cheap_join_checks(node, coordinator_peer_id: str) -> tuple[Handshake, list[Check]]:
    """What `join` checks once its node is up: the handshake (versions, run state, clock). Raises
    TransportError when the coordinator does not answer; one that answers but does not serve the handshake
    yet (NotServed: it is starting, loading its model) is waited for up to STARTING_GRACE_S."""
    from asyncrl.swarm.transport import NotServed

    from .pacing import STARTING_GRACE_S

    started = time.time()
    while True:
        try:
            hs = exchange(node, coordinator_peer_id)
            break
        except ProtocolError:
            raise
        except Exception as exc:
            waited = time.time() - started
            if waited > (STARTING_GRACE_S if isinstance(exc, NotServed) else INFO_TIMEOUT_S * 4):
                raise
            time.sleep(1.0)
    checks = [version_check(hs, local=local_versions())]
    state = run_state_check(hs)
    if state is not None:
        checks.append(state)
    checks.append(clock_check(hs))
    env = environment_check(hs)
    if env is not None:
        checks.append(env)
    checks.append(reward_packages_check(hs))
    return hs, checks


def environment_check(hs: Handshake) -> Check | None:
    """A run of multi-turn episodes names its environment (package, version, source hash: envs/base.py); a
    volunteer without that exact one does not start — it would play another game than the coordinator
    replays. Never a strike: nothing was sent."""
    if not getattr(hs.info, "environment", ""):
        return None
    import json

    from asyncrl import envs

    try:
        expected = json.loads(hs.info.environment)
    except ValueError:
        return Check("environment", FAIL, "the coordinator's environment pin is not JSON", "ask the operator")
    problem = envs.check_pin(expected) if isinstance(expected, dict) else ("the environment pin is not an object", "")
    if problem is None:
        return Check("environment", PASS, f"environment {expected.get('name')!r} {expected.get('version')} matches")
    return Check("environment", FAIL, problem[0], f"install it: {problem[1]}" if problem[1] else "ask the operator")
