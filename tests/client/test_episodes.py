"""The volunteer plays environment leases turn by turn (client/episodes.py): with the real transformers engine
on the tiny model its episodes pass ingest's replay; a scripted engine shows the turn loop (every turn one
engine call, the whole context re-sent, each episode capped at its own budget); an environment that fails
here is an EnvError (the worker abandons that lease only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl import envs
from asyncrl.client.engine import TransformersEngine
from asyncrl.client.engine_api import Sample
from asyncrl.client.episodes import episode_completion, generate_episodes
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.envs.source import episode_prompts
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
LORA = messages.LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=4)


def task_lease(tokenizer, board_prompts) -> messages.TaskLease:
    p = next(board_prompts)
    ids = np.asarray(tokenizer(p.text)["input_ids"], "<i4").tobytes()
    return messages.TaskLease("l1", p.prompt_id, p.text, ids, p.answer, p.reward, 4, SAMPLING, 0.0, p.columns)


class ScriptedEngine:
    """Answers turn k of every context with `turns[k]` + the stop token; records what it was asked."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, turns
        self.stop_token_ids = (tokenizer.eos_token_id,)
        self.calls: list[tuple[int, int]] = []  # (contexts, max_new_tokens) per engine call

    def generate(self, prompts, group_size, sampling):
        assert group_size == 1
        text = self.turns[min(len(self.calls), len(self.turns) - 1)]
        self.calls.append((len(prompts), sampling.max_new_tokens))
        ids = (self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        ids = ids[:sampling.max_new_tokens]
        return [[Sample(ids, [-0.5] * len(ids), "stop")] for _ in prompts]


@pytest.fixture(scope="module")
def tiny_path():
    torch.set_num_threads(1)
    return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))


def test_real_engine_episodes_pass_the_replay(tiny_path):
    engine = TransformersEngine(tiny_path, LORA, seed=3)
    tok = engine.tokenizer
    board = TaskBoard(episode_prompts("echo", [{}], tok), lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tok,
                    vocab_size=engine.vocab_size, current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300,
                    sampling=SAMPLING, stop_token_ids=tuple(engine.stop_token_ids))
    lease = board.lease(ALICE.public_key, 1)[0]
    wire = messages.TaskLease(lease.lease_id, lease.prompt.prompt_id, lease.prompt.text,
                              np.asarray(tok(lease.prompt.text)["input_ids"], "<i4").tobytes(), lease.prompt.answer,
                              lease.prompt.reward, 6, SAMPLING, 0.0, lease.prompt.columns)
    samples = generate_episodes(engine, wire, 6, SAMPLING)
    assert len(samples) == 6 and all(0 <= s.reward <= 1 for s in samples)
    group = messages.RolloutGroup(wire.lease_id, wire.prompt_id, wire.prompt_token_ids,
                                  tuple(episode_completion(s) for s in samples))
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING,
                                  groups=(group,), generated_at=0.0)
    ack = ingest.handle(envelope.seal(ALICE, "rollout_batch", messages.encode(batch), audience=COORD.public_key))
    assert ack.accepted and ack.code is None, ack.detail


def test_turn_by_turn_on_the_engine():
    tok = tinymodel.build_tokenizer()
    engine = ScriptedEngine(tok, ["a", "b", "c"])
    lease = task_lease(tok, episode_prompts("echo", [{}], tok))
    samples = generate_episodes(engine, lease, 4, SAMPLING)
    assert engine.calls == [(4, 4), (4, 4), (4, 4)]  # three turns, the four episodes batched in each
    s = samples[0]
    assert [e for _, _, e in envs.segments(s.env_mask)] == [0, 1, 0, 1, 0]
    targets = envs.get_env("echo").reset({}, envs.seed_for(lease.prompt_id)).state["targets"]
    assert s.reward == pytest.approx(sum(t == said for t, said in zip(targets, "abc")) / 3)


class FailingEcho:
    name, limits = "echo", envs.EnvLimits(max_turns=3, step_timeout_s=1.0)

    def reset(self, record, seed):
        return envs.get_env("echo").reset(record, seed)

    def step(self, state, assistant):
        raise ValueError("the environment's bug")

    def final_reward(self, state):
        return 0.0


def test_a_failing_environment_is_an_env_error(monkeypatch):
    tok = tinymodel.build_tokenizer()
    lease = task_lease(tok, episode_prompts("echo", [{}], tok))
    monkeypatch.setitem(envs.base._CACHE, "echo", FailingEcho())
    with pytest.raises(envs.EnvError):
        generate_episodes(ScriptedEngine(tok, ["a"]), lease, 2, SAMPLING)


class Answered:
    """The part of client.checks.Handshake that environment_check reads."""

    def __init__(self, environment: str):
        from asyncrl.protocol.handshake import CoordinatorInfo

        self.info = CoordinatorInfo(run_id="r", asyncrl_version="0.2.0", protocol=1, schema=2, time=0.0, window_s=1.0,
                                    environment=environment)


def test_a_volunteer_without_the_runs_environment_does_not_start():
    import json

    from asyncrl.client.checks import FAIL, PASS, environment_check
    from asyncrl.coordinator.ingest.episodes import environment_pin

    assert environment_check(Answered("")) is None  # a single-answer run
    assert environment_check(Answered(environment_pin("env:echo"))).status == PASS
    other = dict(json.loads(environment_pin("env:echo")), sha256="0" * 64)
    check = environment_check(Answered(json.dumps(other)))
    assert check.status == FAIL and check.fix.startswith("install it: pip install 'asyncrl==")
    missing = environment_check(Answered(json.dumps({"name": "maze", "package": "maze-env", "version": "0.3"})))
    assert missing.status == FAIL and missing.fix == "install it: pip install 'maze-env==0.3'"
