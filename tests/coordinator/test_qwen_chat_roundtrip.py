"""A Qwen-style conversational prompt goes the whole way with the real Qwen tokenizer (tests/realshape.py):
the coordinator's task source templates it with Qwen's chat template, the lease carries it, the volunteer's
engine generates from it and stops on the pinned set, ingest re-derives how each completion ended and
re-scores it, and the learner trains on it. In process and on a random 2-layer body, so it stays cheap."""

from __future__ import annotations

import json

import numpy as np
import torch

from asyncrl import tasks
from asyncrl.client.engine import TransformersEngine
from asyncrl.coordinator.config_file import resolve_config
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.learner.learner import Learner
from asyncrl.coordinator.learner.loss import LossConfig
from asyncrl.coordinator.leasing import preflight
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.models import pinning
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity
from asyncrl.tasks.sources import encode_prompt

from tests.qwen_tokenizer import require_qwen_tokenizer
from tests.realshape import write_model

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
LORA = messages.LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=8)
CHAT = [{"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": "What is 2+2?"}]
SAMPLED = 2  # completions the engine samples; two more are written out, one ending at each stop token


def sampling_logprobs(engine, prompt: list[int], completion: list[int]) -> list[float]:
    """What an honest engine reports for `completion`: its log-probs under the engine's model (temperature 1)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_a_qwen_chat_prompt_round_trips_lease_generation_ingest_and_learner(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    qwen = require_qwen_tokenizer()
    model = write_model(tmp_path / "model", context=1024)
    # the pin covers Qwen's tokenizer files as published, and Qwen2.5-Instruct's stop set
    pin = pinning.pin_directory(model, name="realshape")
    assert pin.tokenizer_sha256 == pinning.tokenizer_hash(qwen)
    tokenizer = AutoTokenizer.from_pretrained(model)
    im_end, eot = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert pin.stop_token_ids == tuple(sorted((im_end, eot)))

    # coordinator: the conversational record is templated by Qwen's own chat template and leased
    task = tmp_path / "chat.jsonl"
    task.write_text(json.dumps({"prompt": CHAT, "answer": "4"}) + "\n")
    cfg = resolve_config({"model": str(model), "task": str(task), "task_reward": "exact", "group_size": SAMPLED + 2,
                          "max_new_tokens": SAMPLING.max_new_tokens, "prompts_per_lease": 1})
    source = preflight.open_task(cfg, tokenizer, AutoConfig.from_pretrained(model))
    board = TaskBoard(source, lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer,
                    vocab_size=AutoConfig.from_pretrained(model).vocab_size, current_version=lambda: 0,
                    max_batch_bytes=1 << 22, window_s=300, sampling=SAMPLING, stop_token_ids=pin.stop_token_ids)
    lease = board.lease(ALICE.public_key, 1)[0]
    assert lease.prompt.text == tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert lease.prompt.text == ("<|im_start|>system\nAnswer with the number only.<|im_end|>\n"
                                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    prompt_ids = encode_prompt(tokenizer, lease.prompt.text)
    assert prompt_ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # specials are single tokens

    # volunteer: the engine samples, stopping on the pinned set; two answers end at the two stop tokens
    engine = TransformersEngine(str(model), LORA, stop_token_ids=pin.stop_token_ids, seed=0)
    samples = engine.generate([prompt_ids], SAMPLED, SAMPLING)[0]
    answers = [tokenizer.encode("4", add_special_tokens=False) + [im_end],
               tokenizer.encode("5", add_special_tokens=False) + [eot]]
    comps = [(list(s.token_ids), list(s.logprobs), s.finish_reason) for s in samples]
    comps += [(a, sampling_logprobs(engine, prompt_ids, a), "stop") for a in answers]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _, _ in comps]
    rewards = tasks.score_group(lease.prompt, texts, [ids for ids, _, _ in comps]).rewards
    assert rewards[SAMPLED:] == [1.0, 0.0]  # "4" (the special stop token is not part of the answer) and "5"
    group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id, np.asarray(prompt_ids, "<i4").tobytes(),
                                  tuple(messages.Completion(np.asarray(ids, "<i4").tobytes(),
                                                            np.asarray(lp, "<f4").tobytes(), r, finish)
                                        for (ids, lp, finish), r in zip(comps, rewards)))
    batch = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING,
                                  groups=(group,), generated_at=0.0)
    ack = ingest.handle(envelope.seal(ALICE, "rollout_batch", messages.encode(batch), audience=COORD.public_key))
    assert ack.accepted, ack

    # coordinator: the re-scored group reaches the learner with how each completion ended, and trains
    item = ingest.queue.get_nowait()
    (train,) = item.groups
    assert train.prompt_ids == prompt_ids and train.rewards == rewards
    assert train.truncated_flags()[SAMPLED:] == [False, False]  # ended at <|im_end|> / <|endoftext|>
    assert train.truncated_flags()[:SAMPLED] == [s.finish_reason == "length" for s in samples]
    learner = Learner(str(model), LORA, lr=1e-2, loss=LossConfig(), max_staleness=None)
    before = {k: v.clone() for k, v in learner.lora_parameters().items()}
    result = learner.step(item.groups)
    assert result is not None and result.groups_used == 1
    assert any(not torch.equal(before[k], v) for k, v in learner.lora_parameters().items())
