"""Joining a swarm: which address to dial, whom to trust, and dialling again after an outage.

Owned by the swarm transport (docs/transport.md).

Join spec. The multiaddr a volunteer is given ends in `/p2p/<peer id>`. By default that peer *is* the
coordinator, whose Ed25519 key (inside its peer id) signs the pointer and manifests — the trust anchor.
Any other peer's address can bootstrap too; then the coordinator must be named separately, from a
trusted source, because the bootstrap peer could be anyone:

    asyncrl-client join /ip4/198.51.100.7/tcp/40123/p2p/12D3KooWPeer... --coordinator 12D3KooWCoord...

(`asyncrl-coordinator` prints both forms.) A bootstrap peer only introduces us to the DHT; libp2p finds
the coordinator's addresses by its peer id, and nothing from an untrusted peer is believed unless the
coordinator's key signed it. Several addresses may be given — any one that answers suffices (a stock
`hivemind-dht` node, another volunteer, the coordinator's IPv4 and IPv6 addresses); without
`--coordinator` they must all name the same peer, which is then the coordinator.

Re-dialling. hivemind's DHT drops a peer that stops answering from its routing table. When the
coordinator restarts (same key, same port), a volunteer that kept running would otherwise never ask it
anything again. `rejoin` re-dials the bootstrap addresses and pings them into the routing table; the
follower thread calls it when none of them is in the table (`knows_any`). Both run inside the DHT
process through `DHT.run_coroutine`, hence the module-level coroutines.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

from asyncrl.protocol.errors import ProtocolError
from asyncrl.protocol.identity import public_key_from_peer_id

from . import hivemind_private


@dataclass(frozen=True)
class JoinSpec:
    bootstrap: tuple[str, ...]  # multiaddrs to dial first
    coordinator_peer_id: str  # whose key signs adapters (and whom leases/batches go to)
    coordinator_key: bytes

    @property
    def coordinator_is_bootstrap(self) -> bool:
        return any(a.rstrip("/").endswith("/p2p/" + self.coordinator_peer_id) for a in self.bootstrap)


MAX_BOOTSTRAP = 16


def join_spec(address: str | Sequence[str], coordinator: str | None = None) -> JoinSpec:
    """Validate the bootstrap ADDRESS(es) (BadAddress) and the optional --coordinator peer id (BadAddress too)."""
    from .transport import BadAddress, parse_join_address

    texts = [address] if isinstance(address, str) else list(address)
    if not texts or len(texts) > MAX_BOOTSTRAP:
        raise BadAddress(f"give 1 to {MAX_BOOTSTRAP} bootstrap addresses, got {len(texts)}")
    addrs = [parse_join_address(t) for t in texts]
    if coordinator is None and len({a.peer_id for a in addrs}) > 1:
        raise BadAddress("these addresses name several peers: say which one is the coordinator with "
                         "--coordinator <peer id> (from the operator)")
    peer = coordinator or addrs[0].peer_id
    try:
        key = public_key_from_peer_id(peer)
    except ProtocolError:
        what = "--coordinator" if coordinator else "the address's /p2p/ part"
        raise BadAddress(f"{what} {peer!r} is not an Ed25519 peer id (12D3KooW...): the coordinator's key "
                         "must be in it, it is the trust anchor") from None
    return JoinSpec(bootstrap=tuple(a.maddr for a in addrs), coordinator_peer_id=peer, coordinator_key=key)


async def _rejoin(dht, node, maddr: str) -> bool:
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    ma = Multiaddr(maddr)
    peer = PeerID.from_base58(ma.value_for_protocol("p2p"))
    try:
        await hivemind_private.connect(node.p2p, peer, [ma.decapsulate(Multiaddr(f"/p2p/{peer.to_base58()}"))])
    except Exception:
        return False
    return await node.protocol.call_ping(peer) is not None


async def _knows_any(dht, node, peer_ids: tuple[str, ...]) -> bool:
    known = {p.to_base58() for p in node.protocol.routing_table.peer_id_to_uid}
    return any(p in known for p in peer_ids)


def rejoin(node, maddrs) -> bool:
    """Dial each bootstrap address and ping it into the DHT routing table; True if any answered."""
    ok = False
    for maddr in maddrs:
        try:
            ok = bool(node.dht.run_coroutine(partial(_rejoin, maddr=maddr))) or ok
        except Exception:
            pass
    return ok


def knows_any(node, maddrs) -> bool:
    """Is any bootstrap peer in our DHT routing table?"""
    peers = tuple(m.rstrip("/").rsplit("/p2p/", 1)[-1] for m in maddrs)
    try:
        return bool(node.dht.run_coroutine(partial(_knows_any, peer_ids=peers)))
    except Exception:
        return False
