"""GRPO loss against hand-computed values."""

import math

import pytest
import torch

from asyncrl.coordinator.loss import LossConfig, group_advantages, grpo_loss


def test_group_advantages_centre_and_scale():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4])
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, gids, "none")
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, -0.1, 0.1]))
    scaled = group_advantages(rewards, gids, "group", eps=0.0 + 1e-12)
    # group 0: std (unbiased) of [1, 0] = 0.7071 -> +-0.7071
    assert scaled[0].item() == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)
    assert scaled[2].item() == 0.0  # equal rewards: no signal, no NaN
    assert torch.isfinite(scaled).all()


def _setup():
    # two sequences, three positions; the second has only two completion tokens
    logps = torch.log(torch.tensor([[0.5, 0.4, 0.2], [0.3, 0.6, 0.9]]))
    sampling = torch.log(torch.tensor([[0.5, 0.2, 0.2], [0.6, 0.6, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    return logps, sampling, mask, adv


def test_clip_against_sampling_policy_grpo_normalisation():
    logps, sampling, mask, adv = _setup()
    cfg = LossConfig(loss_type="grpo", correction="clip", epsilon=0.2, epsilon_high=0.28)
    out = grpo_loss(logps, sampling, adv, mask, cfg)
    # seq 0 (A=+1): ratios 1, 2, 1 -> min(r, clip(r)) = 1, 1.28, 1 -> per-token loss -1, -1.28, -1
    # seq 1 (A=-1): ratios 0.5, 1 -> -min(-0.5, -0.8) = 0.8, -min(-1, -1) = 1
    seq0 = (-1 - 1.28 - 1) / 3
    seq1 = (0.8 + 1.0) / 2
    assert out.loss.item() == pytest.approx((seq0 + seq1) / 2, rel=1e-5)
    # clipped tokens: seq0 t1 (ratio 2 > 1.28 with A>0) and seq1 t0 (ratio 0.5 < 0.8 with A<0): 2 of 5
    assert out.clip_fraction == pytest.approx(2 / 5)


def test_dapo_and_dr_grpo_normalisations():
    logps, sampling, mask, adv = _setup()
    total = (-1 - 1.28 - 1) + (0.8 + 1.0)
    dapo = grpo_loss(logps, sampling, adv, mask, LossConfig(loss_type="dapo", correction="clip"))
    assert dapo.loss.item() == pytest.approx(total / 5, rel=1e-5)
    dr = grpo_loss(logps, sampling, adv, mask, LossConfig(loss_type="dr_grpo", correction="clip",
                                                         max_completion_length=4))
    assert dr.loss.item() == pytest.approx(total / (2 * 4), rel=1e-5)


def test_truncated_importance_weights_token_level():
    logps, sampling, mask, adv = _setup()
    cfg = LossConfig(loss_type="dapo", correction="tis-token", is_cap=1.5)
    out = grpo_loss(logps, sampling, adv, mask, cfg)
    # ratio vs the detached current policy is 1 everywhere -> per-token -A * w
    # w = min(pi/mu, 1.5): seq0 [1, 2->1.5, 1], seq1 [0.5, 1]
    expected = (-(1 + 1.5 + 1) + (0.5 + 1)) / 5
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.is_truncated_fraction == pytest.approx(1 / 5)


def test_truncated_importance_weights_sequence_level():
    logps, sampling, mask, adv = _setup()
    cfg = LossConfig(loss_type="grpo", correction="tis-sequence", is_cap=1.5)
    out = grpo_loss(logps, sampling, adv, mask, cfg)
    # seq0 weight = min(1*2*1, 1.5) = 1.5; seq1 weight = 0.5*1 = 0.5
    expected = ((-1.5 * 3) / 3 + (0.5 * 2) / 2) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_gradient_pushes_up_positive_advantage_tokens():
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    logps_all = torch.log_softmax(logits, -1)
    tokens = torch.tensor([[1, 2]])
    logps = logps_all.gather(2, tokens.unsqueeze(-1)).squeeze(-1)
    out = grpo_loss(logps, logps.detach(), torch.tensor([1.0]), torch.ones(1, 2), LossConfig())
    out.loss.backward()
    # descending the loss raises the chosen tokens' logits
    assert logits.grad[0, 0, 1] < 0 and logits.grad[0, 1, 2] < 0


def test_group_advantages_uneven_groups_and_singletons():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, -0.5, 0.7])
    gids = torch.tensor([2, 2, 5, 5, 5, 9])  # ids need not be contiguous; group 9 has one member
    centred = group_advantages(rewards, gids, "none")
    assert torch.allclose(centred, torch.tensor([0.5, -0.5, 0.0, 0.5, -0.5, 0.0]))
    scaled = group_advantages(rewards, gids, "group", eps=1e-12)
    # group 5: centred [0, .5, -.5], unbiased var (0 + .25 + .25) / 2 = .25 -> std .5
    assert torch.allclose(scaled[2:5], torch.tensor([0.0, 1.0, -1.0]), atol=1e-5)
    assert scaled[5].item() == 0.0  # a lone sample has no group signal


def test_ratio_and_clip_statistics_split_low_and_high():
    logps, sampling, mask, adv = _setup()
    out = grpo_loss(logps, sampling, adv, mask, LossConfig(correction="clip", epsilon=0.2, epsilon_high=0.28))
    # pi/mu per masked token: seq0 [1, 2, 1], seq1 [0.5, 1]
    assert out.ratio_mean == pytest.approx(5.5 / 5, rel=1e-5)
    assert out.ratio_max == pytest.approx(2.0, rel=1e-5)
    assert out.ratio_min == pytest.approx(0.5, rel=1e-5)
    assert out.clip_low_fraction == pytest.approx(1 / 5)
    assert out.clip_high_fraction == pytest.approx(1 / 5)
    # decoupled mode: the objective's ratio is 1 (no clipping), the behaviour ratio stats are the same
    tis = grpo_loss(logps, sampling, adv, mask, LossConfig(correction="tis-token", is_cap=1.5))
    assert tis.clip_fraction == 0.0
    assert tis.ratio_max == pytest.approx(2.0, rel=1e-5) and tis.ratio_min == pytest.approx(0.5, rel=1e-5)
    assert tis.is_weight_mean == pytest.approx((1 + 1.5 + 1 + 0.5 + 1) / 5, rel=1e-5)
    assert set(out.metrics()) >= {"loss", "ratio_min", "clip_low_fraction", "is_truncated_fraction", "kl_mean"}


def test_k3_kl_penalty_against_reference():
    logps = torch.log(torch.tensor([[0.5, 0.4]]))
    ref = torch.log(torch.tensor([[0.25, 0.4]]))
    mask = torch.ones(1, 2)
    cfg = LossConfig(loss_type="dapo", correction="none", beta=0.1)
    out = grpo_loss(logps, logps.detach(), torch.tensor([0.0]), mask, cfg, ref_logps=ref)
    # k3: exp(ref - logp) - (ref - logp) - 1 = 0.5 - ln(0.5) - 1 = 0.193147 at t0, 0 at t1
    k3 = 0.5 - math.log(0.5) - 1
    assert out.kl_mean == pytest.approx(k3 / 2, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.1 * k3 / 2, rel=1e-5)
    with pytest.raises(ValueError):
        grpo_loss(logps, logps, torch.tensor([0.0]), mask, cfg)  # beta > 0 without a reference


def test_kl_is_added_after_the_importance_weight():
    logps = torch.log(torch.tensor([[0.5, 0.4]]))
    sampling = torch.log(torch.tensor([[0.25, 0.4]]))
    ref = sampling
    mask = torch.ones(1, 2)
    cfg = LossConfig(loss_type="dapo", correction="tis-token", is_cap=3.0, beta=0.5)
    out = grpo_loss(logps, sampling, torch.tensor([1.0]), mask, cfg, ref_logps=ref)
    # w = [2, 1]; policy term -A*w = [-2, -1]; KL term 0.5 * [0.193147, 0] is not weighted
    k3 = 0.5 - math.log(0.5) - 1
    assert out.loss.item() == pytest.approx((-2 + 0.5 * k3 - 1) / 2, rel=1e-5)


def test_loss_config_validation():
    assert LossConfig().validate() == LossConfig()
    for bad in (dict(loss_type="ppo"), dict(correction="magic"), dict(epsilon=0.0), dict(is_cap=0.5),
                dict(beta=-1.0), dict(scale_rewards="batch")):
        with pytest.raises(ValueError):
            LossConfig(**bad).validate()
