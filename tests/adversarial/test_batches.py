"""mallory vs ingest: validly signed batches whose content lies — bad numbers, bad shapes, versions
from the future, forged rewards, leases she does not hold, sampling she was not asked for — and what
repeated lies earn her (strikes, then a ban). alice and bob must not lose a batch meanwhile."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.protocol import messages
from asyncrl.protocol.identity import Identity

from tests.adversarial.swarm import MAX_STRIKES, completion, replace_completions, wait_for

pytestmark = pytest.mark.integration


def leased_groups(mallory, ident):
    leases = mallory.lease(ident, 1)
    current = mallory.follow()
    return mallory.generate(leases, current), current.version


def test_nan_and_inf_logprobs(mallory, attack):
    rec = attack("NaN/inf logprobs", "a completion whose logprobs hold NaN, +inf or -inf")
    for bad in (float("nan"), float("inf"), float("-inf")):
        ident = Identity.generate()
        groups, version = leased_groups(mallory, ident)

        def poison(c):
            lp = np.frombuffer(c.logprobs, dtype="<f4").copy()
            lp[0] = bad
            return messages.Completion(c.token_ids, lp.astype("<f4").tobytes(), c.reward, c.finish_reason)
        code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(replace_completions(groups, poison),
                                                                                   version))))
        rec.saw(code)
        assert code == "MALFORMED"


def test_shape_mismatch(mallory, attack):
    rec = attack("shape mismatch", "fewer logprobs than tokens; a token id outside the vocabulary")
    ident = Identity.generate()
    groups, version = leased_groups(mallory, ident)
    short = replace_completions(groups, lambda c: messages.Completion(c.token_ids, c.logprobs[:-4], c.reward,
                                                                      c.finish_reason))
    code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(short, version))))
    rec.saw(code)
    assert code == "MALFORMED"
    ident = Identity.generate()
    groups, version = leased_groups(mallory, ident)
    outside = replace_completions(groups, lambda c: messages.Completion(
        np.full(len(c.token_ids) // 4, 10**6, dtype="<i4").tobytes(), c.logprobs, c.reward, c.finish_reason))
    code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(outside, version))))
    rec.saw(code)
    assert code == "MALFORMED"


def test_future_adapter_version(mallory, attack):
    rec = attack("future adapter version", "claims an adapter version the coordinator has not published")
    ident = Identity.generate()
    groups, version = leased_groups(mallory, ident)
    code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(groups, version + 1000))))
    rec.saw(code)
    assert code == "FUTURE_VERSION"


def test_forged_rewards(mallory, attack):
    rec = attack("forged rewards", "honest completions, claimed rewards raised to 1.0 (or flipped)")
    ident = Identity.generate()
    groups, version = leased_groups(mallory, ident)
    forged = replace_completions(groups, lambda c: messages.Completion(
        c.token_ids, c.logprobs, 1.0 if c.reward < 1.0 else 0.0, c.finish_reason))
    code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(forged, version))))
    rec.saw(code)
    assert code == "REWARD_MISMATCH"


def test_unknown_lease(mallory, attack):
    rec = attack("forged lease", "a batch for a lease id she never got (and for a prompt not leased)")
    ident = Identity.generate()
    groups, version = leased_groups(mallory, ident)
    g = groups[0]
    for lease_id, prompt_id in (("0-deadbeef", g.prompt_id), (g.lease_id, "repeat-0-999999")):
        fake = [messages.RolloutGroup(lease_id=lease_id, prompt_id=prompt_id, prompt_token_ids=g.prompt_token_ids,
                                      completions=g.completions)]
        code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(fake, version))))
        rec.saw(code)
        assert code == "UNKNOWN_LEASE"


def test_sampling_parameters_not_as_leased(mallory, attack):
    rec = attack("sampling not as leased", "claims temperature 0.1 / 4096 new tokens instead of the leased values")
    for sampling in (messages.SamplingParams(temperature=0.1, max_new_tokens=8),
                     messages.SamplingParams(temperature=1.0, max_new_tokens=4096)):
        ident = Identity.generate()
        groups, version = leased_groups(mallory, ident)
        code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(groups, version, sampling=sampling))))
        rec.saw(code)
        assert code == "MALFORMED"


def test_repeat_offender_is_banned(mallory, swarm, attack):
    rec = attack("repeat offender", f"a forged-reward batch and {MAX_STRIKES} claiming an unpublished version (refused, "
                 f"no strike: rewards are recomputed anyway, and a restarted coordinator's honest volunteers claim "
                 f"such versions), then {MAX_STRIKES} signed batches with sampling not as leased (MALFORMED), then "
                 f"honest work from the same key",
                 note=f"banned after max_strikes={MAX_STRIKES}")
    ident = Identity.generate()
    groups, version = leased_groups(mallory, ident)
    forged = replace_completions(groups, lambda c: messages.Completion(c.token_ids, c.logprobs,
                                                                       1.0 if c.reward < 1 else 0.0, c.finish_reason))
    assert mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(forged, version))))[0] == "REWARD_MISMATCH"
    for _ in range(MAX_STRIKES):  # honest code claims such versions after a coordinator restart: no strike
        groups, version = leased_groups(mallory, ident)
        assert mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(groups, version + 1000))))[0] == \
            "FUTURE_VERSION"
    assert ident.fingerprint not in swarm.trust().get("access", {}).get("banned", [])
    lied = messages.SamplingParams(temperature=0.1, max_new_tokens=8)
    for _ in range(MAX_STRIKES):  # a lie only the key's holder can tell: signed, and not what it was leased
        groups, version = leased_groups(mallory, ident)
        assert mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(groups, version, sampling=lied))))[0] \
            == "MALFORMED"
    assert wait_for(lambda: ident.fingerprint in swarm.trust().get("access", {}).get("banned", []), 30, "the ban")
    with pytest.raises(Exception) as e:  # leases refused too
        mallory.lease_once(ident)
    assert getattr(e.value, "code", None) is not None and e.value.code.value == "NOT_ALLOWED"
    rec.saw("NOT_ALLOWED")
    groups = [messages.RolloutGroup(lease_id="x", prompt_id="y", prompt_token_ids=np.arange(1, 4, dtype="<i4").tobytes(),
                                    completions=(completion([1, 2], [-1.0, -1.0], 0.0),))]
    code, _ = mallory.submit(mallory.seal(ident, messages.encode(mallory.batch(groups, 0))))
    rec.saw(code)
    assert code == "NOT_ALLOWED"


def test_operator_ban_list_is_reloaded_live(mallory, swarm, attack):
    rec = attack("operator ban (live reload)", "the operator adds a key to --banlist while the coordinator runs")
    ident = Identity.generate()
    mallory.lease(ident, 1)  # welcome so far
    with open(swarm.banlist, "a") as f:
        f.write(f"{ident.peer_id}  # mallory\n")
    code = None
    try:
        mallory.lease_once(ident)
    except Exception as exc:
        code = exc.code.value
    rec.saw(code)
    assert code == "NOT_ALLOWED"
