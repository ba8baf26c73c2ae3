"""GRPO loss against hand-computed values."""

import math

import pytest
import torch

from asyncrl.coordinator.learner.loss import LossConfig, group_advantages, grpo_loss


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
    for good in (dict(correction="m2po"), dict(correction="aipo"), dict(correction="decoupled"),
                 dict(dual_clip=0.0), dict(dual_clip=1.5), dict(stale_weighting="decay")):
        LossConfig(**good).validate()
    for bad in (dict(loss_type="ppo"), dict(correction="magic"), dict(epsilon=0.0), dict(is_cap=0.5),
                dict(beta=-1.0), dict(scale_rewards="batch"), dict(dual_clip=1.0), dict(dual_clip=-3.0),
                dict(aipo_cap=0.5), dict(m2_threshold=0.0), dict(prox_lag=0), dict(stale_weighting="ess"),
                dict(stale_half_life=0.0)):
        with pytest.raises(ValueError):
            LossConfig(**bad).validate()


# --- corrections for stale samples (coordinator/learner/corrections.py) ---------------------------------


def _grad(cfg: LossConfig, p, mu, adv, mask=None):
    logps = torch.log(torch.tensor(p)).requires_grad_(True)
    sampling = torch.log(torch.tensor(mu))
    mask = torch.ones_like(logps) if mask is None else torch.tensor(mask)
    out = grpo_loss(logps, sampling, torch.tensor(adv), mask, cfg)
    out.loss.backward()
    return out, logps.grad


def test_dual_clip_bounds_a_negative_advantage_on_a_token_the_policy_now_favours():
    # ratios pi/mu = [4, 1], A = -1, token-mean normalisation
    p, mu = [[0.8, 0.3]], [[0.2, 0.3]]
    plain, g_plain = _grad(LossConfig(loss_type="dapo", correction="clip", dual_clip=0.0), p, mu, [-1.0])
    # without dual-clip: -min(rA, clip(r)A) = |A| max(r, clip(r)) = [4, 1] -> mean 2.5
    assert plain.loss.item() == pytest.approx(2.5, rel=1e-5)
    assert g_plain[0, 0].item() == pytest.approx(4 / 2, rel=1e-5)  # d(r)/d(log pi) = r, / 2 tokens
    dual, g_dual = _grad(LossConfig(loss_type="dapo", correction="clip", dual_clip=3.0), p, mu, [-1.0])
    # dual-clip c = 3: min(|A| max(r, clip r), c|A|) = [3, 1] -> 2.0, and the r = 4 token has no gradient
    assert dual.loss.item() == pytest.approx(2.0, rel=1e-5)
    assert g_dual[0, 0].item() == 0.0 and g_dual[0, 1].item() == pytest.approx(0.5, rel=1e-5)
    assert dual.masked_fraction == pytest.approx(1 / 2)
    loose, _ = _grad(LossConfig(loss_type="dapo", correction="clip", dual_clip=5.0), p, mu, [-1.0])
    assert loose.loss.item() == pytest.approx(2.5, rel=1e-5)  # r = 4 < c = 5: no bound
    pos, _ = _grad(LossConfig(loss_type="dapo", correction="clip", dual_clip=3.0), p, mu, [1.0])
    assert pos.loss.item() == pytest.approx((-1.28 - 1.0) / 2, rel=1e-5)  # A > 0 is never dual-clipped


def test_aipo_caps_the_ratio_one_sided_and_stops_the_gradient_above_the_cap():
    logps, sampling, mask, adv = _setup()
    logps.requires_grad_(True)
    out = grpo_loss(logps, sampling, adv, mask, LossConfig(loss_type="dapo", correction="aipo", aipo_cap=1.5))
    # -min(r, 1.5) A: seq0 (A=+1) r [1, 2, 1] -> [-1, -1.5, -1]; seq1 (A=-1) r [0.5, 1] -> [0.5, 1]
    assert out.loss.item() == pytest.approx((-3.5 + 1.5) / 5, rel=1e-5)
    assert out.is_truncated_fraction == pytest.approx(1 / 5) and out.masked_fraction == pytest.approx(1 / 5)
    out.loss.backward()
    g = logps.grad
    assert g[0, 1].item() == 0.0  # above the cap
    assert g[0, 0].item() == pytest.approx(-1 / 5, rel=1e-5)  # -A r / N
    assert g[1, 0].item() == pytest.approx(0.5 / 5, rel=1e-5)  # below the cap the full IS weight, either sign


def _m2po_rows():
    # mu = 0.25 everywhere; ratios seq0 [1, 2, 1.1], seq1 [0.6, 1] (+ padding)
    ratios = torch.tensor([[1.0, 2.0, 1.1], [0.6, 1.0, 1.0]])
    sampling = torch.full((2, 3), math.log(0.25))
    logps = (torch.log(ratios) + sampling).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logps, sampling, mask, torch.tensor([1.0, -1.0])


def test_m2po_masks_the_largest_second_moments_until_the_rest_is_under_tau():
    from asyncrl.coordinator.learner.corrections import m2po_keep_mask

    logps, sampling, mask, _ = _m2po_rows()
    log_r = (logps.detach() - sampling) * mask
    # (log r)^2 = [0, .48045, .00908, .26094, 0]; mean of the k smallest: 5 -> .1501, 4 -> .0675, 3 -> .0030
    expect = {0.2: [], 0.1: [(0, 1)], 0.04: [(0, 1), (1, 0)], 0.001: [(0, 1), (1, 0), (0, 2)]}
    for tau, masked in expect.items():
        keep = m2po_keep_mask(log_r, mask, tau)
        want = mask.bool().clone()
        for i, j in masked:
            want[i, j] = False
        assert torch.equal(keep, want), tau
    assert not m2po_keep_mask(torch.full((1, 2), math.log(2.0)), torch.ones(1, 2), 0.04).any()  # no token under tau


def test_m2po_loss_is_the_masked_importance_weighted_advantage():
    logps, sampling, mask, adv = _m2po_rows()
    out = grpo_loss(logps, sampling, adv, mask, LossConfig(loss_type="dapo", correction="m2po", m2_threshold=0.04))
    # kept: seq0 r [1, -, 1.1] with A=+1 -> -1, -1.1; seq1 r [-, 1] with A=-1 -> +1; normalised by all 5 tokens
    assert out.loss.item() == pytest.approx((-1 - 1.1 + 1) / 5, rel=1e-5)
    assert out.masked_fraction == pytest.approx(2 / 5)
    out.loss.backward()
    assert logps.grad[0, 1].item() == 0.0 and logps.grad[1, 0].item() == 0.0
    assert logps.grad[0, 2].item() == pytest.approx(-1.1 / 5, rel=1e-5)  # no clipping on a kept token
    # a mask precomputed over the whole step (micro-batching) is used as given
    logps.grad = None
    keep = torch.ones(2, 3, dtype=torch.bool)
    full = grpo_loss(logps, sampling, adv, mask, LossConfig(loss_type="dapo", correction="m2po"), keep=keep)
    assert full.loss.item() == pytest.approx((-1 - 2 - 1.1 + 0.6 + 1) / 5, rel=1e-5)


def test_off_policy_statistics_second_moments_ess_and_masking_by_staleness():
    logps, sampling, mask, adv = _setup()
    out = grpo_loss(logps, sampling, adv, mask, LossConfig(correction="clip"), staleness=torch.tensor([0, 7]))
    # r = [1, 2, 1, .5, 1]
    ln2 = math.log(2.0)
    assert out.log_ratio_m2 == pytest.approx(2 * ln2 ** 2 / 5, rel=1e-5)
    assert out.is_weight_m2 == pytest.approx((1 + 4 + 1 + 0.25 + 1) / 5, rel=1e-5)
    assert out.ess == pytest.approx(5.5 ** 2 / (5 * 7.25), rel=1e-5)
    # clipped: seq0 t1 (gap 0: 1 of 3 tokens), seq1 t0 (gap 7, band "5-8": 1 of 2)
    assert out.masked_fraction == pytest.approx(2 / 5)
    assert out.masked_by_staleness == pytest.approx({"0": 1 / 3, "5-8": 1 / 2})
    assert out.metrics()["masked_by_staleness"] == out.masked_by_staleness
    # one weight of e^400 neither overflows the ESS nor turns it into NaN
    huge = grpo_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[-400.0, 0.0]]), torch.tensor([1.0]),
                     torch.ones(1, 2), LossConfig(correction="none"))
    assert huge.ess == pytest.approx(0.5, rel=1e-6) and math.isfinite(huge.is_weight_m2)


def test_decay_row_weights_rebalance_a_step_by_version_gap():
    from asyncrl.coordinator.learner.corrections import decay_row_weights

    # 0.5 ** (gap / 8) = [1, 1, .5, .5], normalised to mean 1
    assert decay_row_weights([0, 0, 8, 8], 8.0).tolist() == pytest.approx([4 / 3, 4 / 3, 2 / 3, 2 / 3], rel=1e-6)
    assert decay_row_weights([5, 5, 5], 8.0).tolist() == pytest.approx([1.0] * 3)  # all alike: unchanged
    # the loss multiplies each row's policy term by its weight
    logps, sampling, mask, adv = _setup()
    w = torch.tensor([0.5, 1.5])
    out = grpo_loss(logps, sampling, adv, mask, LossConfig(loss_type="dapo", correction="none"), row_weights=w)
    assert out.loss.item() == pytest.approx((-0.5 * 3 + 1.5 * 2) / 5, rel=1e-5)


def test_decoupled_anchors_the_trust_region_at_most_prox_lag_versions_behind():
    # mu = 0.2 everywhere; row 0 is 16 versions stale with r = [4, 1.21], row 1 is 4 stale with r = [4, 1]
    logps = torch.log(torch.tensor([[0.8, 0.242], [0.8, 0.2]])).requires_grad_(True)
    sampling = torch.log(torch.full((2, 2), 0.2))
    cfg = LossConfig(loss_type="dapo", correction="decoupled", prox_lag=8, is_cap=3.0)
    out = grpo_loss(logps, sampling, torch.tensor([1.0, 1.0]), torch.ones(2, 2), cfg,
                    staleness=torch.tensor([16, 4]))
    # row 0: alpha = (16 - 8) / 16 = 1/2 -> rho = r^(1/2) = [2, 1.1], w = min(r^(1/2), 3) = [2, 1.1]
    #   t0: -min(2, clip(2) = 1.28) * 2 = -2.56 (clipped), t1: -1.1 * 1.1 = -1.21
    # row 1: 4 <= prox_lag -> plain clip against mu: -min(4, 1.28) = -1.28, -1
    assert out.loss.item() == pytest.approx((-2.56 - 1.21 - 1.28 - 1.0) / 4, rel=1e-4)
    assert out.clip_fraction == pytest.approx(2 / 4) and out.masked_fraction == pytest.approx(2 / 4)
    out.loss.backward()
    g = logps.grad
    assert g[0, 0].item() == 0.0 and g[1, 0].item() == 0.0
    assert g[0, 1].item() == pytest.approx(-1.21 / 4, rel=1e-4)  # unclipped: the full IS weight rho * w = r
    assert g[1, 1].item() == pytest.approx(-1.0 / 4, rel=1e-4)
    # without version gaps every row is fresh: the default correction is then exactly `clip`
    as_clip = grpo_loss(logps, sampling, torch.tensor([1.0, 1.0]), torch.ones(2, 2), cfg)
    clip = grpo_loss(logps, sampling, torch.tensor([1.0, 1.0]), torch.ones(2, 2),
                     LossConfig(loss_type="dapo", correction="clip"))
    assert as_clip.loss.item() == pytest.approx(clip.loss.item(), rel=1e-6)
    assert LossConfig().correction == "decoupled" and LossConfig().prox_lag == 4


def test_soft_overlong_penalty_dapo():
    from asyncrl.coordinator.learner.loss import overlong_penalty

    lengths = torch.tensor([10, 12, 13, 15, 16])
    # L_max 16, L_cache 4: free up to 12, then (12 - |y|) / 4 down to -1 at |y| = 16
    got = overlong_penalty(lengths, max_len=16, buffer=4)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0]))
    assert torch.allclose(overlong_penalty(lengths, 16, 4, factor=0.5), got * 0.5)
    assert torch.equal(overlong_penalty(lengths, 16, 0), torch.zeros(5))  # off
    assert overlong_penalty(torch.tensor([17]), 16, 4).item() == -1.0


def test_overlong_config_validation():
    with pytest.raises(ValueError):
        LossConfig(max_completion_length=16, overlong_buffer=16).validate()
    with pytest.raises(ValueError):
        LossConfig(overlong_factor=-1.0).validate()
    LossConfig(max_completion_length=1024, overlong_buffer=256, mask_truncated=True).validate()


class HostReads(torch.Tensor):
    """A tensor that counts every read to the host (item, tolist, float/int/bool) of itself or of anything
    computed from it: on a GPU each is a device sync."""

    names: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
            HostReads.names.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_loss_statistics_reach_the_host_once_per_step_not_per_micro_batch():
    """LossTotals sums micro-batches on the device; the step's statistics are read to the host once, and equal
    the same statistics summed from each micro-batch read alone."""
    from asyncrl.coordinator.learner.loss import LossTotals, policy_terms

    cfg = LossConfig(correction="decoupled", beta=0.0)
    gen = torch.Generator().manual_seed(0)
    parts = []
    for _ in range(3):
        logps = -torch.rand(4, 6, generator=gen)
        mu = logps + 0.3 * torch.randn(4, 6, generator=gen)
        adv = torch.randn(4, generator=gen)
        mask = (torch.rand(4, 6, generator=gen) > 0.2).float()
        parts.append((logps, mu, adv, mask))
    HostReads.names = []
    totals = LossTotals()
    for logps, mu, adv, mask in parts:
        wrap = [t.clone().as_subclass(HostReads) for t in (logps, mu, adv, mask)]
        terms = policy_terms(*wrap, cfg)
        totals.add(terms.per_token.sum(), terms, wrap[2], wrap[3], cfg, entropy=-wrap[0])
    assert HostReads.names == []  # three micro-batches added, nothing read
    stats = totals.stats()
    assert len(HostReads.names) == 1  # one read for the whole step
    totals.stats(), totals.sums, totals.ratio_max
    assert len(HostReads.names) == 1  # read once, then cached
    separate = []
    for logps, mu, adv, mask in parts:
        one = LossTotals()
        terms = policy_terms(logps, mu, adv, mask, cfg)
        one.add(terms.per_token.sum(), terms, adv, mask, cfg, entropy=-logps)
        separate.append(one)
    tokens = sum(o.sums["tokens"] for o in separate)
    assert stats.ratio_mean == pytest.approx(sum(o.sums["ratio"] for o in separate) / tokens, rel=1e-9)
    assert stats.ratio_max == max(o.ratio_max for o in separate)
    assert stats.ratio_min == min(o.ratio_min for o in separate)
    assert stats.entropy_mean == pytest.approx(sum(o.sums["entropy"] for o in separate) / tokens, rel=1e-9)
