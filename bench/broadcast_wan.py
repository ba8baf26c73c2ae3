"""WAN broadcast benchmark: the adapter fan-out over shaped links in network namespaces (issue 16).

    .venv/bin/python bench/broadcast_wan.py --clients 8 --json-out runs/bench/broadcast_wan.json   # root

The lab publisher (bench/swarmlab.py: the real Publisher, ProviderDesk, AdapterServer, no model) sits
behind a 20 Mbit/s uplink (a home or office line), N lab followers (the real AdapterSync, SwarmFetcher,
AdapterServer) behind 100 Mbit/s uplinks; every path has 40 ms RTT and 0.5 % loss. Built with
bench/netlab.py: one namespace per peer, a core router between them, uplinks shaped with `tc tbf`,
delay and loss with `tc netem` where the kernel has it, else the NFQUEUE delay line (20 ms each way on
the router, 0.5 % of forwarded packets dropped; the JSON says which). The adapter is the synthetic
Qwen2.5-1.5B-shaped rank-16 LoRA (36.9 MB raw bf16; bench/synthetic_adapter.py).

Per version (published once every follower holds the previous one):
  t95_s      publish (pointer stored) -> 95 % of followers hold it verified and decoded
  star_s     N x the version's compressed bytes / the coordinator's uplink: what a star (or a bucket
             behind that uplink) needs at best
  ratio      t95_s / star_s (goal <= 0.35)
  coordinator_bytes_ratio   bytes the publisher sent for the version / its compressed bytes (goal <= 2)
Reported: per version, and the median over the deltas (v1..) and over all versions.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/broadcast_wan.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.broadcast import Proc, cpu_seconds  # noqa: E402
from bench.results import provenance, write_result  # noqa: E402
from bench.netlab import Netlab, netns_problem  # noqa: E402



def build(net: Netlab, clients: int, *, coordinator_mbit: float, volunteer_mbit: float, rtt_ms: float, loss: float,
          log_dir: Path) -> dict:
    core = net.ns("core")
    coord = net.ns("pub")
    up, _ = net.link(coord, "10.78.0.2", core, "10.78.0.1")
    net.route_default(coord, "10.78.0.1")
    net.shape(coord, up, coordinator_mbit)
    followers = []
    for i in range(clients):
        ns = net.ns(f"f{i}")
        dev, _ = net.link(ns, f"10.78.{i + 1}.2", core, f"10.78.{i + 1}.1")
        net.route_default(ns, f"10.78.{i + 1}.1")
        net.shape(ns, dev, volunteer_mbit)
        followers.append(ns)
    net.forwarding(core)
    delay = net.delay_line(core, delay_ms=rtt_ms / 2, loss=loss, log=open(log_dir / "delay-line.log", "w"))
    return {"core": core, "pub": coord, "followers": followers, "link_emulation": delay["method"]}


def run(args) -> dict:
    problem = netns_problem()
    if problem is not None:
        raise SystemExit(f"broadcast_wan: cannot build network namespaces here: {problem}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="asyncrl-wan-"))
    if work.exists() and args.work_dir:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    net = Netlab("wan")
    procs: list[Proc] = []
    try:
        topo = build(net, args.clients, coordinator_mbit=args.coordinator_mbit, volunteer_mbit=args.volunteer_mbit,
                     rtt_ms=args.rtt_ms, loss=args.loss, log_dir=work)
        netns = lambda ns: ("ip", "netns", "exec", ns)  # noqa: E731
        pub = Proc("publisher", ["publish", "--run-dir", str(work / "publisher"), "--host", "10.78.0.2", "--port", "31500",
                                 "--layers", str(args.layers), "--chunk-bytes", str(args.chunk_bytes), "--control",
                                 "--presence-every-s", "2"], work, stdin=True, prefix=netns(topo["pub"]))
        procs.append(pub)
        ready = pub.wait_event("ready", 180)
        followers = [Proc(f"f{i}", ["follow", ready["join"], "--data-dir", str(work / f"f{i}"), "--name", f"f{i}",
                                    "--run-id", "lab", "--host", "0.0.0.0", "--digest", "crc32"], work,
                          prefix=netns(ns)) for i, ns in enumerate(topo["followers"])]
        procs += followers
        t_setup = time.time()
        for f in followers:  # every follower is vouched for and named a seeder before the first version
            f.wait_event("peers", 300, lambda e: e["peers"] >= args.clients)
        setup_s = time.time() - t_setup
        need = math.ceil(0.95 * args.clients)
        rows = []
        roles = {pub.p.pid: "publisher", **{f.p.pid: "followers" for f in followers}}
        for v in range(args.versions):
            pub.send("publish")
            published = pub.wait_event("published", 180, lambda e: e["version"] == v)
            cpu_before = cpu_seconds(roles)
            delays = []
            for f in followers:
                try:
                    held = f.wait_event("held", args.version_timeout_s, lambda e: e["version"] >= v)
                except TimeoutError:
                    continue
                if held["version"] == v and held["digest"] == published["digests"]["crc32"]:
                    delays.append(held["t_held"] - published["t_publish"])
            cpu_after = cpu_seconds(roles)
            delays.sort()
            t95 = delays[need - 1] if len(delays) >= need else float("inf")
            star = args.clients * published["compressed_bytes"] * 8 / (args.coordinator_mbit * 1e6)
            rows.append({"version": v, "codec": published["codec"], "compressed_bytes": published["compressed_bytes"],
                         "t95_s": round(t95, 3), "star_s": round(star, 3), "ratio": round(t95 / star, 3),
                         "holders": len(delays),
                         "cpu_s": {k: round(cpu_after[k] - cpu_before.get(k, 0.0), 2) for k in cpu_after}})
            print(f"v{v} {published['codec']:24s} {published['compressed_bytes'] / 1e6:6.2f} MB  t95 {t95:6.2f}s  "
                  f"star {star:6.2f}s  ratio {t95 / star:5.3f}  held by {len(delays)}/{args.clients}", flush=True)
            time.sleep(args.gap_s)
        pub.send("stats")
        stats = pub.wait_event("stats", 60)
        for row in rows:
            sent = stats["bytes_by_version"].get(str(row["version"]), 0)
            row["coordinator_sent_bytes"] = sent
            row["coordinator_bytes_ratio"] = round(sent / row["compressed_bytes"], 3)
        deltas = rows[1:] or rows
        delay_stats = [json.loads(line) for line in (work / "delay-line.log").read_text().splitlines()
                       if line.startswith("{")] if (work / "delay-line.log").exists() else []
        return {
            "clients": args.clients, "versions": args.versions,
            "links": {"coordinator_uplink_mbit": args.coordinator_mbit, "volunteer_uplink_mbit": args.volunteer_mbit,
                      "rtt_ms": args.rtt_ms, "loss": args.loss, "emulation": topo["link_emulation"],
                      "delay_line": delay_stats[-1] if delay_stats else None},
            "adapter_raw_bytes": ready["raw_bytes"],
            "adapter_compressed_bytes": round(statistics.mean(r["compressed_bytes"] for r in rows)),
            "t95_s": statistics.median(r["t95_s"] for r in deltas),
            "star_s": statistics.median(r["star_s"] for r in deltas),
            "ratio": statistics.median(r["ratio"] for r in deltas),
            "coordinator_bytes_ratio": statistics.median(r["coordinator_bytes_ratio"] for r in deltas),
            "ratio_all_versions_max": max(r["ratio"] for r in rows),
            "coordinator_bytes_ratio_max": max(r["coordinator_bytes_ratio"] for r in rows),
            "setup_s": round(setup_s, 1), "per_version": rows,
            **provenance(),
        }
    finally:
        for p in reversed(procs):
            p.stop()
        net.close()
        if not args.keep_work_dir and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--versions", type=int, default=4, help="v0 is a keyframe, the rest deltas")
    p.add_argument("--layers", type=int, default=28, help="28 = Qwen2.5-1.5B (36.9 MB raw bf16 at rank 16)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--coordinator-mbit", type=float, default=20.0)
    p.add_argument("--volunteer-mbit", type=float, default=100.0)
    p.add_argument("--rtt-ms", type=float, default=40.0)
    p.add_argument("--loss", type=float, default=0.005)
    p.add_argument("--gap-s", type=float, default=2.0)
    p.add_argument("--version-timeout-s", type=float, default=120.0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--keep-work-dir", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    write_result(args.json_out, result)
    print(json.dumps({k: result[k] for k in ("clients", "links", "adapter_compressed_bytes", "t95_s", "star_s", "ratio",
                                             "coordinator_bytes_ratio", "ratio_all_versions_max")}, indent=2))
    ok = result["ratio"] <= 0.35 and result["coordinator_bytes_ratio"] <= 2.0
    print("targets (ratio <= 0.35, coordinator bytes per version <= 2x the adapter):", "met" if ok else "MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
