"""Ingest verifies multi-turn episodes by replaying the environment (coordinator/ingest/episodes.py): an honest
calculator episode through the Qwen chat template is accepted; each lie about the environment's side is
refused ENV_MISMATCH and strikes its signer; an environment that fails on our side drops the group unscored
(no strike). Real keys, a real task board and ingest; the policy is scripted (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl import envs
from asyncrl.coordinator.ingest import episodes
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
from asyncrl.envs.source import episode_prompts
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

from tests.envs.chat import qwen_style_tokenizer
from tests.envs.scripted import ScriptedPolicy

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
MALLORY = Identity.from_seed(bytes(range(2, 34)))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=128)
RECORDS = [{"question": "What is 17*23+4?", "answer": "395"}]
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17*23+4"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_style_tokenizer()


def make_ingest(tokenizer, access=None):
    board = TaskBoard(episode_prompts("calculator", RECORDS, tokenizer), lease_timeout_s=60, max_leases_per_client=8)
    return Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer,
                  vocab_size=len(tokenizer), current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300,
                  access=access, sampling=SAMPLING, stop_token_ids=(tokenizer.eos_token_id,))


def play(ingest, tokenizer, who, turns=(CALL, "17*23+4 = 395")):
    """Lease one prompt and play two episodes of it as an honest volunteer would."""
    lease = ingest.board.lease(who.public_key, 1)[0]
    env = envs.get_env(envs.env_name(lease.prompt.reward))
    start = (envs.record_of(lease.prompt.columns, lease.prompt.answer), envs.seed_for(lease.prompt.prompt_id))
    sessions = envs.run_episodes(env, envs.Renderer(tokenizer), [start, start], ScriptedPolicy(tokenizer, list(turns)),
                                 stop_token_ids=(tokenizer.eos_token_id,), max_new_tokens=SAMPLING.max_new_tokens)
    return lease, sessions


def completion(tokens, logprobs, mask, reward, finish="stop"):
    return messages.Completion(np.asarray(tokens, "<i4").tobytes(), np.asarray(logprobs, "<f4").tobytes(), reward,
                               finish, env_mask=np.asarray(mask, np.uint8).tobytes())


def seal(who, lease, sessions, comps=None):
    comps = comps or [completion(s.tokens, s.logprobs, s.env_mask, s.reward, s.finish_reason) for s in sessions]
    group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id,
                                  np.asarray(sessions[0].prompt_ids, "<i4").tobytes(), tuple(comps))
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="v", sampling=SAMPLING, groups=(group,),
                                  generated_at=0.0)
    return envelope.seal(who, "rollout_batch", messages.encode(batch), audience=COORD.public_key)


def test_an_honest_episode_is_accepted_with_its_masks(tokenizer):
    ingest = make_ingest(tokenizer)
    lease, sessions = play(ingest, tokenizer, ALICE)
    ack = ingest.handle(seal(ALICE, lease, sessions))
    assert ack.accepted and ack.code is None
    (group,) = ingest.queue.get_nowait().groups
    assert group.rewards == [1.0, 1.0]
    assert [m.tolist() for m in group.env_masks] == [s.env_mask for s in sessions]
    assert episodes.replay_ms and min(episodes.replay_ms) > 0


def lies(tokenizer, s: envs.Session) -> dict:
    (_, m1, _), (e0, e1, _), (n0, _, _) = envs.segments(s.env_mask)
    three, nine = (tokenizer(d, add_special_tokens=False)["input_ids"][0] for d in "39")
    edited = list(s.tokens)
    edited[e0 + s.tokens[e0:e1].index(three)] = nine  # the tool said 995
    fake = tokenizer(" well done", add_special_tokens=False)["input_ids"]
    own = list(s.env_mask)
    own[n0:n0 + 4] = [1] * 4
    own_lps = [0.0 if m else lp for lp, m in zip(s.logprobs, own)]
    return {
        "edits a tool result": (edited, s.logprobs, s.env_mask, s.reward, "stop"),
        "drops a turn": (s.tokens[:m1], s.logprobs[:m1], s.env_mask[:m1], s.reward, "stop"),
        "appends a fake environment message": (s.tokens + fake, s.logprobs + [0.0] * len(fake),
                                               s.env_mask + [1] * len(fake), s.reward, "stop"),
        "claims a higher final reward": (s.tokens, s.logprobs, s.env_mask, s.reward + 1.0, "stop"),
        "marks its own tokens as environment tokens": (s.tokens, own_lps, own, s.reward, "stop"),
    }


@pytest.mark.parametrize("lie", ["edits a tool result", "drops a turn", "appends a fake environment message",
                                 "claims a higher final reward", "marks its own tokens as environment tokens"])
def test_a_lie_about_the_environment_is_refused_and_struck(tokenizer, lie):
    access = AccessControl(AccessPolicy(max_strikes=1))
    ingest = make_ingest(tokenizer, access)
    lease, sessions = play(ingest, tokenizer, MALLORY, turns=(CALL, "17*23+4 = 394"))  # a wrong answer: reward 0
    honest = completion(sessions[0].tokens, sessions[0].logprobs, sessions[0].env_mask, sessions[0].reward)
    forged = completion(*lies(tokenizer, sessions[1])[lie])
    ack = ingest.handle(seal(MALLORY, lease, sessions, [honest, forged]))
    assert not ack.accepted and ack.code == "ENV_MISMATCH"
    assert access.is_banned(MALLORY.public_key) and ingest.queue.empty()


def test_environment_tokens_on_a_plain_lease_are_refused(tokenizer):
    """Marking sampled tokens as the environment's would take them out of the logprob audit."""
    from asyncrl import tasks

    access = AccessControl(AccessPolicy(max_strikes=1))
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer,
                    vocab_size=len(tokenizer), current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300,
                    access=access, sampling=SAMPLING)
    lease = board.lease(MALLORY.public_key, 1)[0]
    toks = tokenizer("abab", add_special_tokens=False)["input_ids"]
    comp = completion(toks, [-1.0, 0.0, 0.0, -1.0], [0, 1, 1, 0], tasks.score(lease.prompt.reward, "abab",
                                                                            lease.prompt.answer), "length")
    group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id,
                                  np.asarray(tokenizer(lease.prompt.text)["input_ids"], "<i4").tobytes(), (comp,))
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="m",
                                  sampling=messages.SamplingParams(temperature=1.0, max_new_tokens=4), groups=(group,),
                                  generated_at=0.0)
    ingest.sampling = batch.sampling
    ack = ingest.handle(envelope.seal(MALLORY, "rollout_batch", messages.encode(batch), audience=COORD.public_key))
    assert ack.code == "ENV_MISMATCH" and access.is_banned(MALLORY.public_key)


class BrokenCalculator:
    """The calculator, except that its tool step raises here (our install is broken, not the volunteer)."""

    def __init__(self):
        from asyncrl.envs.calculator import CalculatorEnv

        self.inner = CalculatorEnv()
        self.limits, self.name = self.inner.limits, "calculator"

    def reset(self, record, seed):
        return self.inner.reset(record, seed)

    def step(self, state, assistant):
        raise RuntimeError("our environment broke")

    def final_reward(self, state):
        return self.inner.final_reward(state)


def test_an_environment_failing_on_our_side_strikes_nobody(tokenizer, monkeypatch):
    access = AccessControl(AccessPolicy(max_strikes=1))
    ingest = make_ingest(tokenizer, access)
    lease, sessions = play(ingest, tokenizer, ALICE)
    monkeypatch.setitem(envs.base._CACHE, "calculator", BrokenCalculator())
    ack = ingest.handle(seal(ALICE, lease, sessions))
    assert ack.accepted and "could not be scored" in ack.detail
    assert ingest.queue.empty() and access.strikes(ALICE.public_key) == 0
    assert not access.is_banned(ALICE.public_key)


def test_ingest_spells_the_environment_prefix_as_envs_does():
    assert episodes.ENV_PREFIX == envs.ENV_PREFIX


def test_replay_time_reaches_the_metrics(tokenizer):
    from asyncrl.coordinator.operator.metrics import RunStats

    episodes.replay_ms.clear()
    assert episodes.replay_metrics() == {}
    ingest = make_ingest(tokenizer)
    lease, sessions = play(ingest, tokenizer, ALICE)
    assert ingest.handle(seal(ALICE, lease, sessions)).accepted
    (ms,) = episodes.replay_metrics().values()
    assert ms > 0 and len(episodes.replay_ms) == 2
    metrics = RunStats(group_size=2)
    metrics.observe("step", {"step": 1, "reward_mean": 1.0, **episodes.replay_metrics()})
    assert metrics.steps[-1]["episode_replay_ms"] == ms


class ModelConfig:
    max_position_embeddings = 4096


def test_an_environment_task_opens_for_the_coordinator(tokenizer, tmp_path):
    """What the coordinator's start-up does with `--task env:calculator:<jsonl>` (preflight, the handshake's
    reward packages and environment pin): an EnvSource of episode prompts."""
    import json

    from asyncrl.coordinator.config import CoordinatorConfig
    from asyncrl.coordinator.leasing import preflight
    from asyncrl.coordinator.service import task_reward_packages

    path = tmp_path / "arith.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 3))
    cfg = CoordinatorConfig(task=f"env:calculator:{path}", max_new_tokens=64)
    source = preflight.open_task(cfg, tokenizer, ModelConfig())
    prompt = next(source)
    assert prompt.reward == "env:calculator" and json.loads(prompt.columns) == RECORDS[0]
    task_reward_packages(source, cfg)
    assert preflight.context_needed(source, 64) == 0
    assert json.loads(episodes.environment_pin(cfg.task))["name"] == "calculator"
    from asyncrl.tasks.sources import TaskSourceError

    with pytest.raises(TaskSourceError) as err:
        preflight.open_task(CoordinatorConfig(task="env:no-such-env", max_new_tokens=64), tokenizer, ModelConfig())
    assert "no-such-env" in str(err.value)
