"""LeaseDesk: answers a volunteer's sealed LeaseRequest with a LeaseGrant — which prompts, how many.

Beside the TaskBoard (which owns the prompts and their lease books), the desk owns the *policy* of
granting: who may ask (access control: banned keys refused before the signature check, per-key rate
and quota after it), and how much may be in flight. Back-pressure invariant: groups queued for the
learner + groups leased and not yet returned never exceed `max_inflight_groups`, so volunteers cannot
race ahead into work that will be stale when it arrives (docs/decisions.md). Under `--sync` the
SyncRound hands out one grant per live volunteer per version instead.

No network here: `handle(request_bytes, peer)` takes the bytes a P2P handler read and returns the
bytes to answer, so tests drive it in-process with sealed envelopes (tests/coordinator/test_leasing.py).
Unattributable garbage (no valid signature) is charged to the transport peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.tasks.sources import encode_prompt

MAX_LEASE_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class LeasePolicy:
    run_id: str
    group_size: int
    prompts_per_lease: int
    max_inflight_groups: int
    window_s: float

    @classmethod
    def from_config(cls, cfg) -> "LeasePolicy":
        return cls(run_id=cfg.run_id, group_size=cfg.group_size, prompts_per_lease=cfg.prompts_per_lease,
                   max_inflight_groups=cfg.max_inflight_groups, window_s=cfg.timestamp_window_s)


class LeaseDesk:
    def __init__(self, policy: LeasePolicy, *, audience: bytes, board, ingest, access, tokenizer,
                 current_version: Callable[[], int], sync_round=None):
        self.policy = policy
        self.audience = audience  # the coordinator's public key: requests sealed for anyone else are refused
        self.board, self.ingest, self.access, self.sync_round = board, ingest, access, sync_round
        self.tokenizer = tokenizer
        self.current_version = current_version

    def handle(self, request: bytes, peer: str = "") -> bytes:
        """Sealed LeaseRequest bytes -> encoded LeaseGrant; raises ProtocolError with a stable code."""
        try:
            return self._grant(request)
        except ProtocolError as exc:  # unattributable garbage strikes the transport peer (coordinator/access.py)
            self.access.on_reject(exc.code, signer=None, peer=peer)
            raise

    def room(self) -> int:
        """Groups that may still be leased before the in-flight bound is reached."""
        return self.policy.max_inflight_groups - self.ingest.queued() - self.board.counts()["outstanding"]

    def _grant(self, request: bytes) -> bytes:
        p = self.policy
        if len(request) > envelope.HEADER_BYTES and request[:4] == envelope.MAGIC:
            self.access.check_signer(bytes(request[4:36]))  # banned / not allowed: before the signature check
        opened = envelope.open_envelope(request, max_bytes=MAX_LEASE_REQUEST_BYTES, expected_kind="lease_request",
                                        expected_audience=self.audience, window_s=p.window_s)
        self.access.admit_identity(opened.signer)  # per-key rate, first-contact rate, quota
        req = messages.decode(opened.payload, messages.LeaseRequest, max_bytes=MAX_LEASE_REQUEST_BYTES)
        if req.run_id != p.run_id:
            raise ProtocolError(RejectCode.WRONG_RUN, f"this coordinator runs {p.run_id!r}")
        version = self.current_version()
        want = min(req.max_prompts, p.prompts_per_lease)
        if self.sync_round is not None:  # one grant per live volunteer per version, no back-pressure needed
            grants = self.sync_round.lease(opened.signer, req.adapter_version, version, want)
        else:
            grants = self.board.lease(opened.signer, max(0, min(want, self.room())))
        sampling = self.ingest.sampling  # ingest refuses batches claiming anything else
        leases = tuple(messages.TaskLease(
            lease_id=g.lease_id, prompt_id=g.prompt.prompt_id, prompt=g.prompt.text,
            prompt_token_ids=int32_bytes(encode_prompt(self.tokenizer, g.prompt.text)), answer=g.prompt.answer,
            reward=g.prompt.reward, group_size=p.group_size, sampling=sampling, expires_at=g.expires_at)
            for g in grants)
        self.ingest.note_client(opened.signer, req.client_name)
        return messages.encode(messages.LeaseGrant(run_id=p.run_id, leases=leases, current_version=version))


def int32_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()
