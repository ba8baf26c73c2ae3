"""Swarm lab: lightweight publisher and follower processes for the transport benchmark and tests.

Owned by the swarm transport (docs/transport.md). These are the real transport pieces — SwarmNode,
the DHT validator, Publisher + codec + AdapterServer on the publishing side; AdapterSync, SwarmFetcher,
AdapterServer and the presence beacon on the following side — with no model: the publisher evolves a
synthetic Qwen2.5-1.5B-shaped LoRA (bench/synthetic_adapter.py) and followers only verify, decode
and hash. So the thing measured is the transport, and a test needs no torch model or learner.

    python -m bench.swarmlab publish --run-dir runs/lab --versions 3          # then keeps serving
    python -m bench.swarmlab publish --run-dir runs/lab --control             # "publish"/"stats" on stdin
    python -m bench.swarmlab follow /ip4/127.0.0.1/tcp/PORT/p2p/12D3KooW... --data-dir runs/lab/f0
    python -m bench.swarmlab volunteer /ip4/... --data-dir runs/lab/v0   # + lease and submit (bench/swarm_scale.py)

All print one JSON object per line on stdout (events: ready, published, stats, peers, held); a
follower also keeps <data-dir>/status.json (atomic) with its fetch counters, so a test can watch a
transfer in progress. A `volunteer` is the real client (client/worker.py Volunteer: lease loop with the
coordinator's retry-after, outbox, upload, presence, swarm fetch) around a `ScriptedEngine` that
"generates" random tokens with made-up logprobs and honest rewards — for a real coordinator run with
`--no-audit` (the audit would rightly refuse made-up logprobs): the swarm's costs without a model. `digest` = sha256 over the tensors' bytes in manifest order: equal digests on
both sides mean the follower holds bit-identical tensors.
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import sys
import threading
import time
import zlib
from pathlib import Path

from asyncrl.client.display import write_json_line
from asyncrl.protocol.atomic import write_json_atomic
from asyncrl.swarm import streams

LAB_MODEL = "synthetic-qwen2.5-1.5b"


def emit(event: str, **fields) -> None:
    """One JSON object per line, whole (`client.display.write_json_line`: one write, under a lock). The
    presence watcher is a thread beside the control loop, and print() wrote two events of ~60 KB each (a
    Sybil flood's presence map, the stats) interleaved mid-line: a reader lost both."""
    write_json_line({"event": event, "t": time.time(), **fields})


def digest(specs, tensors: dict[str, bytes], algorithm: str = "sha256") -> str:
    """A digest of the tensors in manifest order: sha256, or crc32 (4x cheaper: the benchmark's choice,
    where nobody is adversarial and the followers' CPU is what is being measured)."""
    if algorithm == "crc32":
        crc = 0
        for spec in specs:
            crc = zlib.crc32(tensors[spec.name], crc)
        return f"crc32:{crc:08x}"
    h = hashlib.sha256()
    for spec in specs:
        h.update(tensors[spec.name])
    return h.hexdigest()


# ---- publisher ----------------------------------------------------------------------------------


class LabPublisher:
    def __init__(self, args):
        from asyncrl.coordinator.publisher import Publisher
        from asyncrl.protocol import messages
        from asyncrl.protocol.identity import Identity
        from asyncrl.swarm.providers import ProviderDesk
        from asyncrl.swarm.records import PointerRecord, PresenceTracker, install_validator
        from asyncrl.swarm.serving import AdapterServer
        from asyncrl.swarm.transport import SwarmNode

        from bench.synthetic_adapter import LINEARS, SyntheticAdapter

        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.identity, _ = Identity.load_or_create(run_dir / "coordinator.key")
        self.identity.write_libp2p_identity(run_dir / "p2p.identity")
        self.node = SwarmNode(host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
                              identity_path=str(run_dir / "p2p.identity"))
        install_validator(self.node, args.run_id, self.node.peer_id)
        self.presence = PresenceTracker(self.node, args.run_id, every_s=args.presence_every_s,
                                        keep=lambda peer: self.providers.vouched(peer)).start()
        self.providers = ProviderDesk(self.node, self.identity, args.run_id, self.presence,
                                      issue_every_s=args.presence_every_s).start()
        self.pointer = PointerRecord(self.node, self.identity, args.run_id, providers=self.providers)
        self.adapter = SyntheticAdapter(layers=args.layers, rank=args.rank, seed=args.seed)
        lora = messages.LoraSpec(r=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                                 target_modules=tuple(m.split(".")[-1] for m in LINEARS))
        self.publisher = Publisher(self.identity, run_id=args.run_id, base_model=LAB_MODEL, base_revision="synthetic",
                                   lora=lora, keyframe_every=args.keyframe_every, chunk_bytes=args.chunk_bytes,
                                   keep=args.keep)
        self.server = AdapterServer(self.node, args.run_id, self.publisher).start()

        async def info(request: bytes, peer: str) -> bytes:
            return args.run_id.encode()

        self.node.serve(streams.INFO, info, max_request_bytes=64)
        self.version = -1
        addr = next(a for a in self.node.visible_maddrs() if "127.0.0.1" in a or "/ip4/" in a)
        self.join = addr if "/p2p/" in addr else f"{addr}/p2p/{self.node.peer_id}"
        (run_dir / "join.txt").write_text(self.join + "\n")
        emit("ready", join=self.join, peer_id=self.node.peer_id, raw_bytes=self.adapter.raw_bytes)
        threading.Thread(target=self._watch_presence, args=(args.presence_every_s,), daemon=True).start()

    def _watch_presence(self, every_s: float) -> None:
        """Emit a `presence` event whenever the set of (peer, versions served) changes, and a `providers`
        event whenever the signed providers record names other seeders or holders."""
        seen, named = None, None
        while True:
            try:
                seen, named = self._watch_once(seen, named)
            except Exception as exc:  # never die silently: tests wait on these events
                emit("warning", message=f"presence watch: {exc.__class__.__name__}: {exc}")
            time.sleep(min(every_s, 1.0))

    def _watch_once(self, seen, named):
        current = {p["peer_id"]: p["versions_served"] for p in self.presence.snapshot(max(self.version, 0))}
        if current != seen:
            seen = current
            emit("presence", peers=current, reads=self.presence.reads, read_stats=dict(self.presence.read_stats))
        record = self.providers.last_record
        now_named = (record.seeders, tuple((h.peer_id, h.versions) for h in record.holders)) if record else None
        if now_named != named:
            named = now_named
            emit("providers", version=record.version, seeders=list(record.seeders),
                 holders={h.peer_id: list(h.versions) for h in record.holders}, desk=self.providers.status())
        return seen, named

    def publish(self) -> None:
        self.version += 1
        self.adapter.step()
        specs, tensors = self.adapter.specs(), self.adapter.tensors()
        pub = self.publisher.publish(self.version, specs, tensors)
        digests = {a: digest(specs, tensors, a) for a in ("sha256", "crc32")}
        t_publish = time.time()  # the clock starts when the pointer goes out; encoding is not transport
        self.pointer.store(pub.pointer_bytes)
        emit("published", version=pub.version, t_publish=t_publish, codec=pub.codec,
             compressed_bytes=pub.compressed_bytes, raw_bytes=pub.raw_bytes, chunks=len(pub.chunks),
             digest=digests["sha256"], digests=digests, store_s=time.time() - t_publish)

    def stats(self) -> None:
        st = self.server.stats
        emit("stats", bytes_sent=st.bytes_sent, chunks_sent=st.chunks_sent, manifests_sent=st.manifests_sent,
             refused=st.refused, bytes_by_version={str(k): v for k, v in sorted(st.bytes_by_version.items())})


def run_publisher(args) -> int:
    lab = LabPublisher(args)
    for _ in range(args.versions):
        lab.publish()
        time.sleep(args.interval)
    if args.control:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "publish":
                lab.publish()
            elif cmd == "stats":
                lab.stats()
            elif cmd == "quit":
                break
    else:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        while not stop.wait(1.0):
            pass
    lab.stats()
    lab.node.shutdown()
    return 0


# ---- follower -----------------------------------------------------------------------------------


def run_follower(args, server_cls=None) -> int:
    from asyncrl.client.adapter_sync import AdapterSync
    from asyncrl.client.swarm_member import SwarmMembership, open_node
    from asyncrl.protocol.identity import Identity
    from asyncrl.swarm.bootstrap import join_spec

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    spec = join_spec(args.address, args.coordinator)
    identity, _ = Identity.load_or_create(data_dir / "identity.key")
    node = open_node(bootstrap=spec.bootstrap, data_dir=data_dir, identity=identity, client_mode=args.client_mode,
                     host=args.host, use_auto_relay=args.auto_relay or bool(args.relay), relays=tuple(args.relay))
    run_id = args.run_id or node.call(spec.coordinator_peer_id, streams.INFO, b"", max_response_bytes=256).decode()
    sync = AdapterSync(node, coordinator_peer_id=spec.coordinator_peer_id, coordinator_key=spec.coordinator_key,
                       run_id=run_id)
    member = SwarmMembership(node, identity=identity, sync=sync, run_id=run_id, name=args.name,
                             bootstrap=spec.bootstrap, serve=not (args.no_serve or args.client_mode),
                             upload_bps=args.upload_bps,
                             poll_s=args.poll_s, server_cls=server_cls,
                             out=lambda m: emit("warning", message=m)).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    held: list[int] = []
    cpu_at = time.process_time()
    peers_seen = -1
    last_status = 0.0
    while not stop.is_set():
        got = sync.poll()
        if got is not None:
            held.append(got.version)
            cpu_now = time.process_time()
            emit("held", name=args.name, version=got.version, t_held=got.held_at, timings=sync.last_timings,
                 cpu_s=round(cpu_now - cpu_at, 3),
                 digest=digest(got.manifest.tensors, got.tensors, args.digest), stats=sync.fetcher.stats.as_dict())
            cpu_at = cpu_now
        peers = len(sync.providers.record.seeders) if sync.providers.record is not None else 0  # vouched seeders
        if peers != peers_seen:
            peers_seen = peers
            emit("peers", name=args.name, peers=peers)
        if time.time() - last_status > 0.5:
            last_status = time.time()
            try:  # p2pd's view: each open connection's remote multiaddr (a relayed one ends in /p2p-circuit)
                connections = node.connected_peers(timeout=2.0)
            except Exception as exc:
                connections = {"error": [f"{exc.__class__.__name__}: {exc}"]}
            write_json_atomic(data_dir / "status.json", {"name": args.name, "peer_id": node.peer_id, "maddrs": member.maddrs,
                                                  "held": held,
                                                  "peers": peers, "banned": sync.fetcher.banned,
                                                  "relayed_dials": node.relayed_dials,
                                                  "call_paths": {p: dict(a) for p, a in node.call_paths.items()},
                                                  "connections": connections, **member.stats()})
        stop.wait(0.05)
    member.stop()
    node.shutdown()
    return 0


# ---- volunteer (real client, scripted engine) ---------------------------------------------------------


class ScriptedEngine:
    """The Engine interface (client/engine.py) without a model: random completion tokens, logprobs made up.
    `gen_s`: seconds each generate() call takes (a stand-in for the model's time; 0 = answer at once)."""

    def __init__(self, seed: int = 0, gen_s: float = 0.0):
        import random

        from asyncrl.models import tinymodel

        self.tokenizer = tinymodel.build_tokenizer()
        self.rng = random.Random(seed)
        self.version: int | None = None
        self.loaded = 0
        self.gen_s = gen_s
        self.stop_token_ids: tuple[int, ...] = ()  # the pinned stop set, from the first manifest (run_volunteer)

    def load_adapter(self, version: int, specs, blobs: dict[str, bytes]) -> None:
        self.version, self.loaded = version, self.loaded + 1

    def generate(self, prompts, group_size: int, sampling):
        from asyncrl.client.engine_api import Sample

        if self.gen_s > 0:
            time.sleep(self.gen_s)
        vocab = len(self.tokenizer) - 1
        stops = set(self.stop_token_ids)
        out = []
        for _ in prompts:
            group = []
            for _ in range(group_size):
                # what an engine that follows the manifest produces (protocol/messages.py derive_finish_reason):
                # no stop token before the end; ended early only on a stop token ("stop"), else full length
                n = self.rng.randint(1, sampling.max_new_tokens) if stops else sampling.max_new_tokens
                ids = [self._non_stop(vocab, stops) for _ in range(n)]
                finish = "length"
                if n < sampling.max_new_tokens:
                    ids[-1], finish = min(stops), "stop"
                group.append(Sample(ids, [-0.5] * len(ids), finish))
            out.append(group)
        return out

    def _non_stop(self, vocab: int, stops: set[int]) -> int:
        while True:
            token = self.rng.randint(1, vocab)
            if token not in stops:
                return token


def run_volunteer(args) -> int:
    from asyncrl.client.worker import Volunteer, VolunteerConfig

    class LabVolunteer(Volunteer):
        def _load(self, adapter) -> None:
            super()._load(adapter)
            emit("held", name=args.name, version=adapter.version, t_held=adapter.held_at)

    cfg = VolunteerConfig(address=args.address, data_dir=Path(args.data_dir), name=args.name, quiet=True,
                          display="quiet", prompts_per_batch=args.prompts_per_batch, host=args.host,
                          coordinator=args.coordinator)
    vol = LabVolunteer(cfg, out=lambda m: emit("info", message=m))
    vol.engine = ScriptedEngine(seed=args.seed, gen_s=args.gen_s)
    vol.model_name = "scripted"
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: (stop.set(), vol.stop.set()))
    vol.connect()
    emit("joined", name=args.name, peer_id=vol.node.peer_id, run_id=vol.run_id)
    current = vol.wait_for_adapter(timeout=300)
    from asyncrl.models.pinning import pin_of

    vol.engine.stop_token_ids = tuple(pin_of(current.manifest).stop_token_ids)  # ingest re-derives finish reasons
    vol._load(current)
    vol.run()
    vol.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.swarmlab", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pub = sub.add_parser("publish", help="a model-free coordinator: publish synthetic adapter versions")
    pub.add_argument("--run-dir", required=True)
    pub.add_argument("--run-id", default="lab")
    pub.add_argument("--host", default="127.0.0.1")
    pub.add_argument("--port", type=int, default=0)
    pub.add_argument("--layers", type=int, default=28, help="28 = Qwen2.5-1.5B (36.9 MB raw bf16 at rank 16)")
    pub.add_argument("--rank", type=int, default=16)
    pub.add_argument("--chunk-bytes", type=int, default=1 << 20)
    pub.add_argument("--keyframe-every", type=int, default=10)
    pub.add_argument("--keep", type=int, default=16, help="recent versions the publisher keeps serving")
    pub.add_argument("--versions", type=int, default=0, help="publish this many versions at start")
    pub.add_argument("--interval", type=float, default=0.0, help="seconds between those versions")
    pub.add_argument("--control", action="store_true", help="then read commands from stdin: publish | stats | quit")
    pub.add_argument("--seed", type=int, default=0)
    pub.add_argument("--presence-every-s", type=float, default=5.0, help="how often to re-read presence")
    fol = sub.add_parser("follow", help="a model-free volunteer: follow, verify, decode and re-serve versions")
    fol.add_argument("address")
    fol.add_argument("--data-dir", required=True)
    fol.add_argument("--name", default="follower")
    fol.add_argument("--coordinator", default=None)
    fol.add_argument("--run-id", default=None)
    fol.add_argument("--upload-bps", type=int, default=0)
    fol.add_argument("--no-serve", action="store_true")
    fol.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 inside a network namespace)")
    fol.add_argument("--client-mode", action="store_true", help="outbound connections only (behind NAT)")
    fol.add_argument("--auto-relay", action="store_true", help="behind NAT: reserve a relay slot (the bootstrap peers)")
    fol.add_argument("--relay", action="append", default=[], help="a relay multiaddr (repeatable; implies --auto-relay)")
    fol.add_argument("--poll-s", type=float, default=2.0, help="DHT pointer poll (pushes usually come first)")
    fol.add_argument("--digest", choices=["sha256", "crc32"], default="sha256", help="of the decoded tensors")
    vol = sub.add_parser("volunteer", help="the real client with a scripted engine: follow, serve, lease, submit")
    vol.add_argument("address")
    vol.add_argument("--data-dir", required=True)
    vol.add_argument("--name", default="volunteer")
    vol.add_argument("--coordinator", default=None)
    vol.add_argument("--host", default="127.0.0.1")
    vol.add_argument("--prompts-per-batch", type=int, default=4)
    vol.add_argument("--seed", type=int, default=0)
    vol.add_argument("--gen-s", type=float, default=0.0,
                     help="seconds each batch's generation takes (the scripted engine sleeps; 0 = at once)")
    return p


def main(argv: list[str] | None = None, *, server_cls=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "publish":
        return run_publisher(args)
    if args.command == "volunteer":
        return run_volunteer(args)
    return run_follower(args, server_cls=server_cls)


if __name__ == "__main__":
    sys.exit(main())
