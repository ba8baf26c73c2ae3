"""Completion.env_mask (multi-turn episodes): optional, strict, and old batches stay valid."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.protocol import messages
from asyncrl.protocol.errors import ProtocolError, RejectCode


def batch(mask: bytes | None, logprobs=(-1.0, 0.0, 0.0, -2.0)) -> messages.RolloutBatch:
    kw = {} if mask is None else {"env_mask": mask}
    comp = messages.Completion(np.arange(1, 5, dtype="<i4").tobytes(), np.asarray(logprobs, "<f4").tobytes(),
                               0.5, "stop", **kw)
    group = messages.RolloutGroup("l", "p", np.arange(3, dtype="<i4").tobytes(), (comp,))
    return messages.RolloutBatch(run_id="r", adapter_version=0, client_name="c", sampling=messages.SamplingParams(),
                                 groups=(group,), generated_at=0.0)


def roundtrip(b: messages.RolloutBatch) -> messages.RolloutBatch:
    return messages.decode_rollout_batch(messages.encode(b), max_bytes=1 << 20)


def test_a_batch_without_the_field_decodes_as_before():
    old = roundtrip(batch(None))
    assert old.groups[0].completions[0].env_mask == b"" and old.groups[0].completions[0].env_mask_array() is None
    assert b"env_mask" not in messages.encode(batch(None))  # the same bytes as before the field existed
    assert roundtrip(batch(b"\x00\x01\x01\x00")).groups[0].completions[0].env_mask_array().tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize("mask,logprobs", [
    (b"\x00\x01\x01", (-1.0, 0.0, 0.0, -2.0)),       # one byte short
    (b"\x00\x02\x01\x00", (-1.0, 0.0, 0.0, -2.0)),   # not 0/1
    (b"\x01\x01\x00\x00", (0.0, 0.0, -1.0, -2.0)),   # starts with an environment token
    (b"\x00\x01\x01\x00", (-1.0, -0.5, 0.0, -2.0)),  # a sampled logprob on an environment token
])
def test_bad_masks_are_malformed(mask, logprobs):
    with pytest.raises(ProtocolError) as err:
        roundtrip(batch(mask, logprobs))
    assert err.value.code is RejectCode.MALFORMED


def test_env_mismatch_is_a_stable_code():
    assert RejectCode("ENV_MISMATCH") is RejectCode.ENV_MISMATCH


def test_the_batch_bound_covers_episode_masks():
    n = 300
    comp = messages.Completion(bytes(4 * n), bytes(4 * n), 0.5, "length", env_mask=bytes(n))
    group = messages.RolloutGroup("l" * 128, "p" * 256, bytes(4 * 20), (comp,) * 4)
    full = messages.RolloutBatch(run_id="r" * 128, adapter_version=0, client_name="c" * 128,
                                 sampling=messages.SamplingParams(), groups=(group, group), generated_at=0.0)
    shape = dict(groups=2, group_size=4, max_new_tokens=n, prompt_tokens=20)
    size = len(messages.encode(full))
    assert messages.rollout_batch_bytes_bound(**shape) < size <= messages.rollout_batch_bytes_bound(**shape, episodes=True)
