"""The chunked LM head (models/logprobs.py) against plain autograd over full logits: values, entropy and
every gradient, across chunk boundaries, with temperatures and a bias."""

from __future__ import annotations

import pytest
import torch

from asyncrl.models.logprobs import head_chunk_tokens, head_logprobs


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_chunked_head_matches_full_log_softmax(chunk):
    gen = torch.Generator().manual_seed(0)
    n, h, v = 7, 5, 11
    head = torch.nn.Linear(h, v)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    inv_temp = torch.rand(n, generator=gen) + 0.5
    upstream = torch.randn(n, generator=gen)

    logp, ent = head_logprobs(head, hidden, targets, inv_temp, chunk)
    (logp * upstream).sum().backward()
    ours = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    hidden.grad = head.weight.grad = head.bias.grad = None

    logits = head(hidden) * inv_temp.unsqueeze(1)
    full = torch.log_softmax(logits, dim=-1)
    want = full.gather(1, targets.unsqueeze(1)).squeeze(1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1).detach(), rtol=1e-5, atol=1e-5)
    for got, ref in zip(ours, (hidden.grad, head.weight.grad, head.bias.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    _, no_ent = head_logprobs(head, hidden.detach(), targets, inv_temp, chunk, with_entropy=False)
    assert not no_ent.any()


def test_chunk_size_follows_the_byte_budget():
    assert head_chunk_tokens(151936) == 441  # 256 MiB of fp32 logits at Qwen2.5's vocabulary
    assert head_chunk_tokens(64) > 1_000_000 and head_chunk_tokens(10**12) == 1
