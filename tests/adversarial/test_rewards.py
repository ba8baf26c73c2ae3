"""Reward scoring under attack, with the real `math` reward (real math-verify in real worker processes) and the
coordinator's real Ingest, TaskBoard and access control, in-process (the shared swarm's task is the toy one):

  * reward-timeout DoS: mallory's completions are expressions math-verify never finishes with
    ("9**9**9**9"), sent alongside honest volunteers' batches. Before, one shared worker was reset on her
    timeout and every honest check in flight scored 0 -> REWARD_MISMATCH and a strike for the honest.
  * poison prompts: a task record whose reference answer itself hangs the verifier. Nobody can be scored
    on it; nobody may be blamed for it.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from asyncrl.coordinator.access import AccessControl, AccessPolicy
from asyncrl.coordinator.ingest import Ingest
from asyncrl.coordinator.taskboard import TaskBoard
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity
from asyncrl.tasks import Prompt
from asyncrl.tasks.sources import encode_prompt

pytestmark = pytest.mark.integration

COORD = Identity.generate()
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=16)
STUCK = "9**9**9**9"  # math-verify (sympy) does not finish with it in any time we would wait


def math_prompts(poison_every: int = 0):
    for i in itertools.count():
        answer = STUCK if poison_every and i % poison_every == poison_every - 1 else str(2 * i)
        yield Prompt(prompt_id=f"m{i}", text=f"what is {i}+{i}?", answer=answer, reward="math")


@pytest.fixture(scope="module")
def verifiers():
    import importlib

    math_reward = importlib.import_module("asyncrl.tasks.math_reward")  # the module (the package exports a function of that name)
    old = math_reward._pool
    math_reward._pool = math_reward.VerifierPool(workers=4, per_key=2, timeout_s=3.0, acquire_s=60.0)
    yield math_reward._pool
    math_reward._pool.close()
    math_reward._pool = old


def make_ingest(poison_every: int = 0):
    tok = tinymodel.build_tokenizer()
    access = AccessControl(AccessPolicy(max_strikes=1))
    board = TaskBoard(math_prompts(poison_every), lease_timeout_s=120, max_leases_per_client=16)
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="math", board=board, tokenizer=tok, vocab_size=64,
                    current_version=lambda: 0, max_batch_bytes=1 << 22, window_s=300, access=access, sampling=SAMPLING)
    return ingest, board, access, tok


def sealed(ingest, tok, who: Identity, leases, text_for, claim_for) -> bytes:
    groups = []
    for lease in leases:
        comps = []
        for j in range(2):
            text = text_for(lease, j)
            ids = tok(text)["input_ids"]
            comps.append(messages.Completion(np.asarray(ids, "<i4").tobytes(), np.full(len(ids), -1.0, "<f4").tobytes(),
                                             claim_for(lease, j), "stop"))
        groups.append(messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id,
                                            np.asarray(encode_prompt(tok, lease.prompt.text), "<i4").tobytes(),
                                            tuple(comps)))
    batch = messages.RolloutBatch(run_id="math", adapter_version=0, client_name="v", sampling=SAMPLING,
                                  groups=tuple(groups), generated_at=0.0)
    return envelope.seal(who, "rollout_batch", messages.encode(batch), audience=COORD.public_key)


def honest_text(lease, j):
    return lease.prompt.answer if j == 0 else "7"  # one right answer, one wrong


def honest_claim(lease, j):
    return 1.0 if j == 0 else float(lease.prompt.answer == "7")


def run_all(calls):
    out = [None] * len(calls)

    def one(i, fn):
        out[i] = fn()

    threads = [threading.Thread(target=one, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_reward_timeouts_of_one_sender_never_cost_honest_volunteers(verifiers, attack):
    rec = attack("reward-timeout DoS", f"mallory's completions are {STUCK!r}, which math-verify never finishes, sent "
                 "at the same time as two honest volunteers' batches (real math reward, in-process ingest)",
                 note="her checks time out on their own workers (her groups dropped as unscorable); every honest "
                      "check in flight still scores")
    ingest, board, access, tok = make_ingest()
    mallory, alice, bob = Identity.generate(), Identity.generate(), Identity.generate()
    attacks = [sealed(ingest, tok, mallory, board.lease(mallory.public_key, 2), lambda l, j: STUCK,
                      lambda l, j: 0.0) for _ in range(3)]
    honest = [sealed(ingest, tok, who, board.lease(who.public_key, 2), honest_text, honest_claim)
              for who in (alice, bob) for _ in range(3)]
    acks = run_all([lambda d=d: ingest.handle(d) for d in attacks + honest])
    mine, theirs = acks[:len(attacks)], acks[len(attacks):]
    for ack in theirs:
        assert ack.accepted and ack.code is None, ack
    rec.honest_extra = sum(not a.accepted for a in theirs)
    for ack in mine:  # nothing of hers is trained: both her groups could not be scored
        assert ack.accepted and ack.code is None
        rec.saw("UNSCORABLE")
    assert ingest.unscorable_groups == 2 * len(attacks) and ingest.queued_groups == 2 * len(honest)
    assert access.strikes(alice.public_key) == access.strikes(bob.public_key) == 0
    assert verifiers.stats["timeouts"] == 2 * len(attacks) and verifiers.stats["killed"] >= 2 * len(attacks)
    assert board.balanced(ingest.queued_groups)


def test_a_poison_prompt_is_dropped_and_blames_nobody(verifiers, attack):
    rec = attack("poison prompts", f"a task record whose reference answer is {STUCK!r} (math-verify never finishes): "
                 "honest volunteers' groups for it", note="the group is dropped as unscorable, no strike; the rest "
                 "of the batch is trained")
    ingest, board, access, tok = make_ingest(poison_every=2)  # every second prompt is poisoned
    alice = Identity.generate()
    acks = []
    for _ in range(2):
        leases = board.lease(alice.public_key, 2)
        assert [l.prompt.answer == STUCK for l in leases] == [False, True]
        acks.append(ingest.handle(sealed(ingest, tok, alice, leases, honest_text, lambda l, j: 0.0 if
                                         l.prompt.answer == STUCK else honest_claim(l, j))))
    for ack in acks:
        assert ack.accepted and ack.code is None, ack
        rec.saw("UNSCORABLE")
    rec.honest_extra = sum(not a.accepted for a in acks)
    assert ingest.unscorable_groups == 2 and ingest.queued_groups == 2  # the good groups are trained
    assert access.strikes(alice.public_key) == 0 and not access.is_banned(alice.public_key)
    c = board.counts()
    assert c["dropped"] == 2 and board.balanced(ingest.queued_groups)
