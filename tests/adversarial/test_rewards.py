"""Reward checks under attack, on a swarm of its own: a dataset scored by `math` (math-verify, each check in
its own time-limited worker process: tasks/math_reward.py), two honest volunteers (carol, dave) and mallory.

* **reward-timeout DoS**: mallory's completions are an expression math-verify never finishes evaluating; each
  of her checks kills only its own worker after the time limit and drops her group as unscorable (no
  strike: the failure is ours), while carol's and dave's checks, on other workers, go on — their batches
  are accepted throughout and none is refused.
* **poison prompts**: one record of the dataset has a gold answer no check finishes on. Whoever leases it
  cannot score it: carol and dave send no group for it and report the lease unscorable
  (`LeaseRequest.unscorable`; nobody is struck); once two distinct keys reported it the coordinator retires
  the record (`--prompt-max-failures 2`) instead of re-leasing it forever, in this epoch or any later one.

This module does not use the package's shared swarm (its coordinator scores the toy task, which cannot
time out), so it is its own xdist work unit (tests/conftest.py) and runs beside the heavy unit. Its rows
go to tests/artifacts/adversarial_rewards.json; `python -m tests.adversarial.report` merges them into
docs/SECURITY.md's table. The audit is off here (`--no-audit`): the rows are about reward scoring (which
runs before the audit), and with it off the outcome recorded is the reward check's alone.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from asyncrl.protocol import messages
from asyncrl.protocol.identity import Identity

from tests.adversarial.swarm import RUN_ID, AttackRecord, Mallory, Swarm, completion, own_rows, start_volunteers
from tests.conftest import Procs, wait_for, wait_for_join

pytestmark = pytest.mark.integration

ARTIFACT_NAME = "adversarial_rewards.json"
HANG = "9**9**9**9+0+0+0"  # as a completion, math-verify evaluates 9^(9^(9^9)): it never finishes
POISON_ANSWER = "$9^{9^{9^{8}}}$"  # as a gold answer, the same: no completion can be scored against it (not HANG's
# value: math-verify may find two identical towers equal without evaluating them)
POISON_PROMPT = "answer with a number: 9^9^9^9"
"""math-verify evaluates the gold tower only against a completion it parses as math: the tiny model's
completions of this prompt parse ~69 % of the time (96 samples, temperature 1), so nearly every group of 4
hangs. The wording before ("what is 9 to the 9 to the 9 to the 9?") parsed ~5 %: most groups scored 0 at
once, each scored group reset the record's reports, and a CI run saw no retirement in 300 s."""
MAX_NEW_TOKENS, GROUP_SIZE = 16, 4
# Every stuck check burns a core until its time limit: 3 s instead of 10 keeps this module from slowing the
# rest of the suite (same limit on every process of this swarm).
CHECK_TIME = {"ASYNCRL_REWARD_TIMEOUT_S": "3"}
FLAGS = ["--run-id", RUN_ID, "--max-steps", "0", "--threads", "1", "--groups-per-step", "4", "--max-staleness", "-1",
         "--max-wait-s", "2", "--prompt-max-failures", "2", "--checkpoint-every", "0",
         "--no-dashboard", "--no-audit", "--group-size", str(GROUP_SIZE), "--prompts-per-lease", "2",
         "--max-new-tokens", str(MAX_NEW_TOKENS)]


def dataset(path):
    rows = [{"prompt": f"what is {a}+{b}?", "answer": str(a + b), "reward": "math"}
            for a in range(1, 5) for b in range(1, 4)]
    rows.insert(5, {"prompt": POISON_PROMPT, "answer": POISON_ANSWER, "reward": "math"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def math_swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("adversarial-rewards")
    procs = Procs(root)
    run = root / "run"
    coord = procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--model", "tiny", "--run-dir", str(run),
                                        "--task", str(dataset(root / "math.jsonl")), *FLAGS], env=CHECK_TIME)
    records: dict[str, AttackRecord] = {}
    try:
        join = wait_for_join(run, 240, coord)
        honest = start_volunteers(procs, join, root, ("carol", "dave"), env=CHECK_TIME)
        s = Swarm(root=root, run=run, join=join, coordinator_pid=coord.pid, honest=honest)
        s.results = records
        with own_rows(s, ARTIFACT_NAME):
            yield s
    finally:
        procs.reap()


@pytest.fixture(scope="module")
def mallory(math_swarm):
    m = Mallory(math_swarm)
    yield m
    m.close()


def books(swarm: Swarm) -> dict:
    return swarm.trust().get("books") or {}


def client_book(swarm: Swarm, ident: Identity) -> dict:
    from asyncrl.protocol.identity import fingerprint

    return swarm.trust()["clients"].get(fingerprint(ident.public_key), {})


def hang_tokens() -> list[int]:
    """HANG as the tiny model's token ids: exactly max_new_tokens of them (finish reason "length")."""
    from transformers import AutoTokenizer

    from asyncrl.models import tinymodel

    tok = AutoTokenizer.from_pretrained(str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir())))
    ids = tok.encode(HANG, add_special_tokens=False)
    assert len(ids) == MAX_NEW_TOKENS and tok.decode(ids) == HANG
    return ids


def hang_batch(mallory: Mallory, ident: Identity, leases, ids) -> bytes:
    """A signed batch answering `leases` with completions that are all HANG."""
    groups = [messages.RolloutGroup(lease_id=l.lease_id, prompt_id=l.prompt_id, prompt_token_ids=l.prompt_token_ids,
                                    completions=tuple(completion(ids, [-1.0] * len(ids), 0.0)
                                                      for _ in range(l.group_size)))
              for l in leases]
    batch = mallory.batch(groups, 0, sampling=leases[0].sampling)
    return mallory.seal(ident, messages.encode(batch))


def test_reward_timeout_dos_costs_only_the_attackers_groups(math_swarm, mallory):
    swarm = math_swarm
    rec = swarm.results["reward-timeout DoS"] = AttackRecord(
        "reward-timeout DoS", f"a signed batch of completions \"{HANG}\" (math-verify never finishes on them) from one "
        "key, 3 at once, while carol and dave submit math answers scored by the same verifier pool",
        note="each stuck check is cut at its time limit in its own worker and drops only that group, as "
             "UNSCORABLE (no strike); tried = her groups")
    before_rejected = swarm.honest_rejections()
    acked0 = swarm.acked()
    ident, ids = Identity.generate(), hang_tokens()
    answers: dict[int, tuple] = {}

    def send(i, sealed):
        answers[i] = mallory.submit(sealed)

    threads, t0, sent = [], time.monotonic(), 0
    for i in range(3):  # each batch sent as soon as its leases are granted: the three overlap at the verifier
        leases = mallory.lease(ident, 2)  # one or two (as much room as the coordinator has)
        sent += len(leases)
        sealed = hang_batch(mallory, ident, leases, ids)
        threads.append(threading.Thread(target=send, args=(i, sealed)))
        threads[-1].start()
    for t in threads:
        t.join(240)
    elapsed = time.monotonic() - t0
    # While her checks hung, the honest volunteers were scored and accepted as usual.
    wait_for(lambda: swarm.acked() >= acked0 + 2, 120, "carol and dave to be acked during the attack")
    dropped = 0
    for code, ack in answers.values():
        assert code == "ACCEPTED" and ack is not None, ({i: (c, a and a.detail) for i, (c, a) in answers.items()}, elapsed)
        # accepted, every group dropped
        assert "could not be scored here" in ack.detail, ack.detail
        dropped += int(ack.detail.split()[0])
    assert dropped == sent, (dropped, sent)
    for _ in range(dropped):
        rec.saw("UNSCORABLE")
    book = client_book(swarm, ident)
    assert not book.get("rejected"), book  # no strike, no refusal on her books either
    assert swarm.honest_rejections() == before_rejected
    rec.honest_lost = swarm.honest_rejections() - before_rejected
    rec.note += f"; {dropped} groups dropped in {elapsed:.0f} s, carol and dave acked {swarm.acked() - acked0} meanwhile"


def test_a_poison_prompt_is_retired_and_nobody_is_struck(math_swarm):
    swarm = math_swarm
    rec = swarm.results["poison prompts"] = AttackRecord(
        "poison prompts", "a dataset record whose gold answer no check finishes on (\"9^{9^{9^{8}}}\"): every "
        "volunteer that leases it cannot score it", note="the honest volunteers send no group for it and report the "
        "lease unscorable (nobody struck); once 2 distinct keys reported it (--prompt-max-failures 2) the record is "
        "retired, never leased again in any epoch; tried = the reports that retired it")
    before_rejected = swarm.honest_rejections()
    retired = wait_for(lambda: books(swarm).get("prompts_retired", 0) >= 1 and books(swarm), 300,
                       "the poison prompt to be retired")
    assert retired["prompts_retired"] == 1, retired  # only the poison; every other record is scorable
    unscorable = {n: swarm.status(n).get("groups_unscorable", 0) for n in swarm.honest}
    assert sum(unscorable.values()) >= 1, unscorable  # they met it, and did not send a guess
    # Retired for good: from here on, leases keep coming and the count stays at 1.
    acked = swarm.acked()
    wait_for(lambda: swarm.acked() >= acked + 4, 180, "four more honest batches after the retirement")
    assert books(swarm)["prompts_retired"] == 1
    assert swarm.honest_rejections() == before_rejected
    for name in swarm.honest:
        assert not swarm.trust()["clients"].get(swarm.status(name)["fingerprint"], {}).get("rejected")
    for _ in range(2):  # the two distinct keys' reports that retired it
        rec.saw("RETIRED")
    rec.honest_lost = swarm.honest_rejections() - before_rejected
    rec.note += f"; honest volunteers' unscorable groups: {unscorable}; retired ids {retired['retired_prompt_ids']}"
