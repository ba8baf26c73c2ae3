"""A multi-turn episode in the learner: environment tokens are context only. The loss and gradients of an
episode (model turn, environment turn, model turn) equal the textbook computation over its model tokens
alone (full-vocabulary autograd, environment positions left out), fp32, rtol 1e-4; the audit's mask leaves
the environment tokens out."""

from __future__ import annotations

import pytest
import torch

from asyncrl.coordinator.learner.learner import TrainGroup, rows_of
from asyncrl.coordinator.learner.loss import LossConfig
from asyncrl.models import tinymodel

from .test_microbatch import grads, learner  # a learner whose adapter is already non-zero; raw gradients

PROMPT = [5, 9, 12, 3]
EPISODES = [  # (tokens after the prompt, env mask, reward)
    ([7, 8, 0, 20, 21, 22, 23, 9, 10, 0], [0, 0, 0, 1, 1, 1, 1, 0, 0, 0], 1.0),
    ([11, 0, 30, 31, 32, 33, 14, 15, 16, 0], [0, 0, 1, 1, 1, 1, 0, 0, 0, 0], 0.0),
    ([4, 4, 4, 0, 24, 25, 26, 27, 6, 0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0], 0.5),
]


@pytest.fixture(scope="module")
def tiny_path():
    torch.set_num_threads(1)
    return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))


def token_logps(model, prompt, comp, temperature=1.0, limit=None):
    """Over the tokenizer's `limit` ids: the padded embedding rows are outside the distribution (models/logprobs.py)."""
    ids = torch.tensor([prompt + comp])
    logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :, :limit] / temperature, dim=-1)
    p = len(prompt)
    return logp[p - 1:p - 1 + len(comp)].gather(1, torch.tensor(comp).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_episode_loss_is_the_loss_over_its_model_tokens(tiny_path, loss_type):
    cfg = LossConfig(loss_type=loss_type, correction="clip")
    lr = learner(tiny_path, cfg)
    with torch.no_grad():  # on-policy sampling logprobs on model tokens (ratio 1, no clipping); 0.0 on env ones
        sampling = [(token_logps(lr.model, PROMPT, c, limit=len(lr.tokenizer)) * (1 - torch.tensor(m, dtype=torch.float32))).tolist()
                    for c, m, _ in EPISODES]
    group = TrainGroup(PROMPT, [c for c, _, _ in EPISODES], sampling, [r for _, _, r in EPISODES], version=0,
                       env_masks=[m for _, m, _ in EPISODES])

    rewards = torch.tensor([r for _, _, r in EPISODES])
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    total_model_tokens = sum(m.count(0) for _, m, _ in EPISODES)
    expected_loss = torch.zeros(())
    for (comp, mask, _), a in zip(EPISODES, adv):
        keep = torch.tensor(mask) == 0
        logp = token_logps(lr.model, PROMPT, comp, limit=len(lr.tokenizer))[keep]  # the model tokens alone
        per_token = -a * torch.exp(logp - logp.detach())
        expected_loss = expected_loss + (per_token.mean() / len(EPISODES) if loss_type == "grpo"
                                         else per_token.sum() / total_model_tokens)
    lr.optimizer.zero_grad(set_to_none=True)
    expected_loss.backward()
    expected = grads(lr)

    result = lr.step([group])
    assert result.loss == pytest.approx(float(expected_loss.detach()), rel=1e-4, abs=1e-7)
    got = grads(lr)
    assert set(got) == set(expected)
    for k in got:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-7, msg=k)


def test_environment_tokens_are_outside_the_audit_and_the_loss(tiny_path):
    lr = learner(tiny_path, LossConfig())
    group = TrainGroup(PROMPT, [c for c, _, _ in EPISODES], [[-1.0] * len(c) for c, _, _ in EPISODES],
                       [r for _, _, r in EPISODES], version=0, env_masks=[m for _, m, _ in EPISODES])
    _, audited = lr.score_groups([group])
    for row, (comp, mask, _) in zip(audited, EPISODES):
        assert row[:len(comp)].tolist() == [1.0 - m for m in mask]
    assert [r.mask() for r in rows_of([group])] == [[1.0 - m for m in mask] for _, mask, _ in EPISODES]
    plain = TrainGroup(PROMPT, [c for c, _, _ in EPISODES], [[-1.0] * len(c) for c, _, _ in EPISODES],
                       [1.0, 0.0, 0.5], version=0)
    assert all(row[:10].tolist() == [1.0] * 10 for row in lr.score_groups([plain])[1])
