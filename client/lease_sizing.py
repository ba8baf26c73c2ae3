"""LeaseSizer: work sized to the machine — how many prompts to ask for, and whether to ask at all.

A volunteer measures itself: the wall time from a grant to its batch's ack, per prompt (generation,
scoring, the upload; the duty cycle's rest comes after the ack and holds no lease), smoothed over
leases. Each grant says what a prompt must be back within: the lease's life with renewals
(`lease_max_s`), and max_staleness + 1 versions at the coordinator's recent publish interval
(`messages.lease_budget_s`, the formula both sides use). The next request asks for

    n = floor(LEASE_SAFETY * budget / seconds_per_prompt), at least 1 while one prompt fits the budget,

capped by the larger of `--prompts-per-batch` and the engine's efficient batch: enough prompts that
their G samples each fill the sequences the engine runs at once (vLLM's `max_num_seqs`), since one
engine call serves a whole lease. The first lease, before any measurement, is a single prompt. A slow
machine therefore takes less — never work that would expire or go stale — and a machine that cannot
return even one prompt in time asks for nothing and reports its rate: the coordinator answers
TOO_SLOW with the numbers (coordinator/leasing/leasing.py), and the volunteer stops with that message.
`--fixed-lease-size` turns this off (always `--prompts-per-batch`, no rate reported): the comparison
the tests and benchmarks make.
"""

from __future__ import annotations

import math

from asyncrl.protocol import messages

SMOOTHING = 0.5
"""Weight of the newest lease in the per-prompt estimate (two leases halve an old spike)."""


class LeaseSizer:
    def __init__(self, max_prompts: int, *, fixed: bool = False):
        self.max_prompts = max_prompts
        self.fixed = fixed
        self.engine_seqs = 0  # sequences the engine runs at once (0 = not said: --prompts-per-batch caps)
        self.group_size = 0  # samples per prompt, from the grants
        self.seconds_per_prompt = 0.0  # 0 = not measured yet
        self.budget_s = math.inf
        self.sizes: list[int] = []  # prompts asked for, per request (status.json: the sizing at work)

    def observe_grant(self, grant: messages.LeaseGrant) -> None:
        self.budget_s = messages.lease_budget_s(grant.lease_life_s, grant.max_staleness, grant.version_interval_s)
        if grant.leases:
            self.group_size = grant.leases[0].group_size

    def cap(self) -> int:
        """The most prompts worth asking for: --prompts-per-batch, or more when that leaves the engine idle."""
        if not self.engine_seqs or not self.group_size:
            return self.max_prompts
        return max(self.max_prompts, math.ceil(self.engine_seqs / self.group_size))

    def measured(self, prompts: int, wall_s: float) -> None:
        """A lease of `prompts` came back (acked) `wall_s` seconds after its grant."""
        if prompts <= 0 or wall_s <= 0:
            return
        per = wall_s / prompts
        self.seconds_per_prompt = per if not self.seconds_per_prompt else (
            SMOOTHING * per + (1 - SMOOTHING) * self.seconds_per_prompt)

    def want(self) -> int:
        """Prompts to ask for now (0: this machine cannot return one in time; ask with max_prompts=0)."""
        if self.fixed:
            return self.max_prompts
        if not self.seconds_per_prompt:
            return 1  # measure first
        if self.seconds_per_prompt > self.budget_s:
            return 0
        cap = self.cap()
        n = cap if math.isinf(self.budget_s) else int(messages.LEASE_SAFETY * self.budget_s / self.seconds_per_prompt)
        return max(1, min(cap, n))

    def reported_rate(self) -> float:
        """What the lease request tells the coordinator (nothing with --fixed-lease-size)."""
        return 0.0 if self.fixed else self.seconds_per_prompt
