"""A scripted policy for episode tests: turn k of every live episode answers `turns[k]` (+ the stop token)."""

from __future__ import annotations


class ScriptedPolicy:
    def __init__(self, tokenizer, turns: list[str], logprob: float = -1.0):
        self.tokenizer, self.turns, self.logprob = tokenizer, turns, logprob
        self.calls = 0
        self.contexts: list[list[list[int]]] = []

    def __call__(self, contexts: list[list[int]], caps: list[int]) -> list[tuple[list[int], list[float]]]:
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        self.contexts.append([list(c) for c in contexts])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [(ids[:cap], [self.logprob] * len(ids[:cap])) for cap in caps]
