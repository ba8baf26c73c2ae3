"""Reject codes and the one exception the wire contract raises.

Every refusal on the wire carries a `RejectCode`: a stable, machine-readable name that both sides,
the logs and the tests agree on (tests assert on `.code`, never on message text). The value of each
member equals its name, so a code survives a round trip through `Ack.code` as a plain string.

Exception tree (deliberately flat: callers branch on `.code`, not on the class)::

    Exception
     └── ProtocolError(code: RejectCode, detail: str)

Anything in `asyncrl.protocol` that rejects *input bytes* raises `ProtocolError` and nothing else;
misuse by the caller (e.g. a 31-byte audience passed to `seal`) raises `ValueError`/`TypeError`.
"""

from __future__ import annotations

import enum


class RejectCode(str, enum.Enum):
    """Why a message was refused. Value == name; add members, never rename or remove them."""

    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # over the size cap; refused before any decoding
    MALFORMED = "MALFORMED"  # not decodable, or decodable but violates a validation rule
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"  # other envelope magic or message schema
    SIGNATURE_MISMATCH = "SIGNATURE_MISMATCH"  # Ed25519 signature does not verify
    WRONG_AUDIENCE = "WRONG_AUDIENCE"  # sealed for another recipient
    EXPIRED = "EXPIRED"  # timestamp outside the accepted window (past or future)
    NONCE_REUSED = "NONCE_REUSED"  # replay of an envelope already accepted
    DUPLICATE_BATCH = "DUPLICATE_BATCH"  # payload id already ingested
    STALE_VERSION = "STALE_VERSION"  # generated with an adapter older than max_staleness allows
    FUTURE_VERSION = "FUTURE_VERSION"  # claims an adapter version not (yet) published, e.g. a superseded one
    REWARD_MISMATCH = "REWARD_MISMATCH"  # re-scored reward differs from the claimed one
    LOGPROB_MISMATCH = "LOGPROB_MISMATCH"  # spot-checked logprobs differ from the claimed ones
    NOT_ALLOWED = "NOT_ALLOWED"  # signer not on the allow list / not the expected signer
    RATE_LIMITED = "RATE_LIMITED"  # too many requests from this signer
    UNKNOWN_LEASE = "UNKNOWN_LEASE"  # lease id never issued, expired or owned by someone else
    HASH_MISMATCH = "HASH_MISMATCH"  # content does not match its signed sha256
    WRONG_RUN = "WRONG_RUN"  # message belongs to another run_id
    RUN_FINISHED = "RUN_FINISHED"  # the run is over: no more leases, batches are no longer trained
    TOO_SLOW = "TOO_SLOW"  # the volunteer's measured rate cannot return one prompt within the lease / staleness budget
    INTERNAL = "INTERNAL"  # our fault, not the sender's
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # a request's bytes did not arrive in time (slow-drip stream cut)
    UNSCORABLE = "UNSCORABLE"  # our reward check could not finish (timeout/crash): not the sender's fault
    ENV_MISMATCH = "ENV_MISMATCH"  # an episode's environment turns differ from the environment's replay (envs/)
    OUT_OF_VOCAB = "OUT_OF_VOCAB"  # a completion holds a token id at or beyond the tokenizer's length (never sampled honestly)
    REWARD_PACKAGE_MISSING = "REWARD_PACKAGE_MISSING"  # the volunteer lacks a package (at its version) the run's rewards come from
    UNVOUCHED = "UNVOUCHED"  # a claimed fetch source the coordinator does not vouch for (its probe went unanswered)

    def __str__(self) -> str:
        return self.value


class ProtocolError(Exception):
    """A message was rejected; `.code` says why (stable), `.detail` says where (for humans)."""

    def __init__(self, code: RejectCode, detail: str = "") -> None:
        self.code = RejectCode(code)
        self.detail = detail
        super().__init__(code, detail)

    def __str__(self) -> str:
        return f"{self.code.value}: {self.detail}" if self.detail else self.code.value

    def __repr__(self) -> str:
        return f"ProtocolError({self.code.value}, {self.detail!r})"

    def __reduce__(self):  # keep it picklable for multiprocessing (code/detail, not args)
        return (type(self), (self.code, self.detail))
