"""SwarmMembership: what makes a volunteer a swarm peer rather than a star client of the coordinator.

Owned by the swarm transport (docs/transport.md). The hub (client/worker.py) calls `open_node` and then
`SwarmMembership(...).start()` once it knows the run id; after that, on their own threads:

  - the DHT validator refuses pointer/presence records not signed by their rightful key (every node
    runs it, volunteers included: swarm/records.py);
  - AdapterSync follows the pointer in the background and fetches from peers first;
  - the adapter versions this volunteer holds are served to other volunteers (unless client mode
    or `--no-serve`), paced by `--max-upload-mbps`;
  - a presence record (version generated with, versions served, throughput) is re-announced in its
    own presence shard every ~8 s (jittered), and soon after a new version arrived; it names no
    addresses (a restarted coordinator dials back only addresses it saw us connect from);
  - the coordinator's pushes of new pointers are accepted on `asyncrl.<run>.pointer` (verified);
  - the follower re-dials the bootstrap address when the coordinator dropped out of the DHT.

The volunteer's libp2p identity is its own Ed25519 key (data_dir/identity.key), so its peer id names
the key that signs its presence record and its batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

FOLLOW_POLL_S = 2.0
"""DHT pointer poll interval. New versions normally arrive sooner: the coordinator pushes each pointer
to the volunteers it sees in presence, and a peer asking us for a version we lack wakes the poll."""


def open_node(*, bootstrap, data_dir: Path, identity, client_mode: bool, host: str = "127.0.0.1", port: int = 0,
              announce=(), use_relay: bool = True, use_auto_relay: bool = False, relays=()):
    """A SwarmNode whose peer id is this volunteer's identity (create it before CUDA: the DHT forks)."""
    from asyncrl.swarm.transport import SwarmNode

    identity.write_libp2p_identity(data_dir / "p2p.identity")
    proto = "ip6" if ":" in host else "ip4"
    # --auto-relay says "I am behind NAT": reserve at the relays now rather than after AutoNAT agrees
    return SwarmNode(initial_peers=list(bootstrap), host_maddrs=[f"/{proto}/{host}/tcp/{port}"],
                     announce_maddrs=list(announce) or None, client_mode=client_mode,
                     identity_path=str(data_dir / "p2p.identity"), use_relay=use_relay, use_auto_relay=use_auto_relay,
                     trusted_relays=tuple(relays), force_reachability="private" if use_auto_relay else None)


class SwarmMembership:
    def __init__(self, node, *, identity, sync, run_id: str, name: str, bootstrap, serve: bool = True,
                 upload_bps: float = 0, snapshot: Callable[[], dict] = dict, poll_s: float = FOLLOW_POLL_S, out=None,
                 server_cls=None):
        self.node, self.identity, self.sync, self.run_id, self.name = node, identity, sync, run_id, name
        self.bootstrap = list(bootstrap)
        self.serve = serve
        self.upload_bps = int(upload_bps or 0)
        self.snapshot = snapshot
        self.poll_s = poll_s
        self.out = out
        self.server_cls = server_cls
        self.beacon = None
        self.maddrs: list[str] = []

    def start(self) -> "SwarmMembership":
        from asyncrl.swarm.records import PresenceBeacon, install_validator

        install_validator(self.node, self.run_id, self.sync.peer)
        if self.serve:
            self.sync.serve(upload_bps=self.upload_bps, server_cls=self.server_cls)
        else:
            self.sync.store.keep = 1  # nobody asks us: keep only what the next delta needs
        self.sync.bootstrap = self.bootstrap
        if self.serve:  # shown in status.json (presence names no addresses: swarm/records.py)
            self.maddrs = [m.split("/p2p/")[0] for m in self.node.visible_maddrs()][:8]
        self.beacon = PresenceBeacon(self.node, self.identity, self.run_id, self.name, self._presence_fields,
                                     out=self.out).start()
        self.sync.on_new_version = self.beacon.announce_soon  # tell the swarm soon that we hold it
        self.sync.start_following(self.poll_s, out=self.out)
        return self

    def _presence_fields(self) -> dict:
        fields = {"versions": self.sync.versions_served() if self.serve else [], "serving": self.serve,
                  "upload_bps": self.upload_bps,
                  "adapter_version": self.sync.current.version if self.sync.current else -1}
        fields.update(self.snapshot())
        return fields

    def stats(self) -> dict:
        server = self.sync.server
        return {"fetch": self.sync.fetcher.stats.as_dict(),
                "served": {"bytes": server.stats.bytes_sent, "chunks": server.stats.chunks_sent,
                           "manifests": server.stats.manifests_sent} if server is not None else None,
                "presence_announced": self.beacon.announced if self.beacon else 0,
                "providers": {"reads": self.sync.providers.reads, "bytes": self.sync.providers.bytes_read,
                              "seeders": len(self.sync.providers.record.seeders) if self.sync.providers.record else 0},
                "sync_errors": self.sync.errors}

    def stop(self) -> None:
        self.sync.stop()
        if self.beacon is not None:
            self.beacon.stop()


# ---- command line (asyncrl-client join) ------------------------------------------------------------


def add_swarm_arguments(join) -> None:
    g = join.add_argument_group("swarm and NAT (docs/transport.md)")
    g.add_argument("--coordinator", default=None, metavar="PEER_ID",
                   help="the coordinator's peer id (12D3KooW...) when ADDRESS is another peer's address; "
                        "take it from the operator, not from that peer: it is whose signature is trusted")
    g.add_argument("--host", default="0.0.0.0",
                   help="IP to listen on for other volunteers (default all interfaces; 127.0.0.1 = this machine only)")
    g.add_argument("--port", type=int, default=0, help="TCP port to listen on (0 = any; fix it to forward it on a NAT)")
    g.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="address to announce instead of the listen address, e.g. /ip4/<public ip>/tcp/<port> "
                        "after a port forward (repeatable)")
    g.add_argument("--max-upload-mbps", type=float, default=0.0, metavar="MBIT",
                   help="cap adapter bytes served to other volunteers, in megabit/s (0 = unlimited)")
    g.add_argument("--no-serve", dest="serve", action="store_false",
                   help="do not re-serve adapter chunks to other volunteers (implied by --client-mode)")
    g.add_argument("--no-relay", dest="use_relay", action="store_false",
                   help="do not use libp2p circuit relays at all")
    g.add_argument("--auto-relay", dest="use_auto_relay", action="store_true",
                   help="behind NAT without port forwarding: find a relay and become reachable through it")
    g.add_argument("--relay", dest="relays", action="append", default=[], metavar="MULTIADDR",
                   help="a relay to use (repeatable; implies --auto-relay)")


def swarm_config(args) -> dict:
    """VolunteerConfig fields from the parsed swarm arguments (ValueError on bad values)."""
    if args.max_upload_mbps < 0:
        raise ValueError("--max-upload-mbps must be >= 0")
    if not 0 <= args.port <= 65535:
        raise ValueError("--port must be in [0, 65535]")
    from multiaddr import Multiaddr

    for maddr in args.announce:
        try:
            Multiaddr(maddr)
        except Exception:
            raise ValueError(f"--announce {maddr!r} is not a multiaddr (e.g. /ip4/203.0.113.5/tcp/31338)") from None
    return dict(coordinator=args.coordinator, serve=args.serve, max_upload_bps=int(args.max_upload_mbps * 1e6 / 8),
                host=args.host, port=args.port, announce=tuple(args.announce),
                use_relay=args.use_relay, use_auto_relay=args.use_auto_relay or bool(args.relays),
                relays=tuple(args.relays))
