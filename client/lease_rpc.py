"""The volunteer's one lease RPC: build a LeaseRequest, seal it for the coordinator, call, decode the grant.

Every message a volunteer sends on the lease stream goes through `LeaseRpc.call` — asking for work,
renewing the leases it works on (client/lease_keeper.py), returning leases (a pause, a stop, groups it
could not score) and the goodbye at the end of a run — so the request's common fields (run, name,
client version: the coordinator's version gate applies to each of them) are filled in one place.
"""

from __future__ import annotations

from asyncrl.protocol import envelope, handshake, limits, messages
from asyncrl.swarm import streams
from asyncrl.swarm.streams import stream_name


class LeaseRpc:
    def __init__(self, node, identity, *, coordinator_peer_id: str, coordinator_key: bytes, run_id: str,
                 client_name: str):
        self.node = node
        self.identity = identity
        self.coordinator_peer_id = coordinator_peer_id
        self.coordinator_key = coordinator_key
        self.run_id = run_id
        self.client_name = client_name

    def call(self, *, adapter_version: int, max_prompts: int = 0, timeout: float | None = None,
             **fields) -> messages.LeaseGrant:
        """One sealed LeaseRequest; its grant. `fields`: renew / release / unscorable / seconds_per_prompt.
        Raises TransportError (unreachable) or ProtocolError (refused: its code)."""
        req = messages.LeaseRequest(run_id=self.run_id, max_prompts=max_prompts, adapter_version=adapter_version,
                                    client_name=self.client_name, client_version=handshake.package_version(),
                                    **fields)
        sealed = envelope.seal(self.identity, "lease_request", messages.encode(req), audience=self.coordinator_key)
        kw = {} if timeout is None else {"timeout": timeout}
        raw = self.node.call(self.coordinator_peer_id, stream_name(self.run_id, streams.LEASE), sealed,
                             max_response_bytes=limits.MAX_LEASE_GRANT_BYTES, **kw)
        return messages.decode(raw, messages.LeaseGrant, max_bytes=limits.MAX_LEASE_GRANT_BYTES)
