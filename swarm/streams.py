"""Every P2P stream name the swarm serves, built in one place.

Run-scoped streams are `asyncrl.<run id>.<kind>`, so one p2pd can serve several runs and a peer of
another run gets "no such handler", never a wrong answer. `INFO` is the only unscoped one: the
handshake (protocol/handshake.py) that tells a volunteer the run id — it needs it before it can name
anything else — with the coordinator's versions, version gate, clock and run state.

    kind       served by                 request -> response
    info       coordinator               InfoRequest -> CoordinatorInfo (msgpack); b"" -> bare run id (asyncrl 0.1)
    manifest   coordinator, volunteers   u64 version [| u32 wait_ms] -> sealed manifest
    chunk      coordinator, volunteers   u64 version | u32 index [| u32 wait_ms] -> chunk bytes
    pointer    volunteers                sealed pointer (a push) -> b""
    lease      coordinator               sealed LeaseRequest -> LeaseGrant
    submit     coordinator               sealed RolloutBatch -> Ack
"""

from __future__ import annotations

INFO = "asyncrl.info"
MANIFEST, CHUNK, POINTER, LEASE, SUBMIT = "manifest", "chunk", "pointer", "lease", "submit"
KINDS = (MANIFEST, CHUNK, POINTER, LEASE, SUBMIT)


def stream_name(run_id: str, kind: str) -> str:
    """The stream `kind` of run `run_id` (`asyncrl.<run>.<kind>`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown stream kind {kind!r}; known: {KINDS}")
    return f"asyncrl.{run_id}.{kind}"
