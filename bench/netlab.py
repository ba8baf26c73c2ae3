"""Network lab: real Linux network namespaces, veth links, a NAT router and WAN-like links, for the NAT
test (tests/integration/test_nat.py) and the WAN broadcast benchmark (bench/broadcast_wan.py).

Owned by the swarm transport (docs/transport.md "NAT for real", docs/scale.md). Needs root (or
CAP_NET_ADMIN) and `ip` (iproute2), `tc`, `iptables`; `make test` installs iptables/nftables.

    Netlab(prefix)            namespaces + veth pairs + addresses + routes; `run(ns, *cmd)`, `popen(ns, argv)`;
                              `close()` deletes every namespace it made (and so every link)
    Netlab.router(...)        a routing namespace (ip_forward) every host hangs off, on its own /24
    Netlab.nat(...)           a NAT router: masquerade to its WAN side, no new connections in, LANs isolated
                              from each other (no hairpin), like two homes behind one ISP CGNAT
    Netlab.shape(ns, dev, rate_mbit)   the host's uplink: kernel `tbf`
    DelayLine (`python -m bench.netlab delay ...`)
                              one-way delay + random loss on everything a router forwards. Uses `tc netem`
                              when the kernel has it; this machine's kernel does not (CONFIG_NET_SCH_NETEM is
                              not set: `tc qdisc add ... netem` answers "Specified qdisc kind is unknown"), so
                              the fallback is a userspace delay line on an iptables NFQUEUE: the kernel hands
                              each forwarded packet's id (metadata only, no copy) to this process, which
                              releases it `delay_ms` later (one batch verdict per tick) or drops it with
                              probability `loss`. Packets stay in the kernel; TCP sees real delay and loss.

`netns_problem()` says why namespaces cannot be used here (None when they can); tests fail loudly on it
under CI=true and skip loudly elsewhere — never pass silently.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections import deque


class NetlabError(RuntimeError):
    pass


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetlabError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def netns_problem() -> str | None:
    """Why this machine cannot build the lab (None when it can)."""
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test installs iproute2 and iptables)"
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_NET_ADMIN)"
    probe = f"asyncrl-probe-{uuid.uuid4().hex[:6]}"
    r = _sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    try:
        r = _sh("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", check=False)
        if r.returncode != 0:
            return f"iptables nat table unusable in a namespace: {r.stderr.strip()}"
        _sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        r = _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit",
                "burst", "32kb", "latency", "50ms", check=False)
        if r.returncode != 0:
            return f"tc tbf unusable: {r.stderr.strip()}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return None


def has_netem() -> bool:
    probe = f"asyncrl-probe-{uuid.uuid4().hex[:6]}"
    _sh("ip", "netns", "add", probe)
    try:
        _sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        return _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    finally:
        _sh("ip", "netns", "del", probe, check=False)


class Netlab:
    def __init__(self, prefix: str = "arl"):
        self.prefix = f"{prefix}{uuid.uuid4().hex[:4]}"
        self.namespaces: list[str] = []
        self._links = 0
        self.procs: list[subprocess.Popen] = []

    # ---- building ---------------------------------------------------------------------------------
    def ns(self, name: str) -> str:
        full = f"{self.prefix}-{name}"
        _sh("ip", "netns", "add", full)
        self.namespaces.append(full)
        self.run(full, "ip", "link", "set", "lo", "up")
        return full

    def run(self, ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return _sh("ip", "netns", "exec", ns, *cmd, check=check)

    def link(self, a: str, a_ip: str, b: str, b_ip: str, prefix_len: int = 24) -> tuple[str, str]:
        """A veth pair between namespaces a and b, addressed a_ip / b_ip; returns the device names."""
        self._links += 1
        da, db = f"v{self._links}a", f"v{self._links}b"
        _sh("ip", "link", "add", da, "netns", a, "type", "veth", "peer", "name", db, "netns", b)
        for ns, dev, ip in ((a, da, a_ip), (b, db, b_ip)):
            self.run(ns, "ip", "addr", "add", f"{ip}/{prefix_len}", "dev", dev)
            self.run(ns, "ip", "link", "set", dev, "up")
        return da, db

    def route_default(self, ns: str, via: str) -> None:
        self.run(ns, "ip", "route", "add", "default", "via", via)

    def forwarding(self, ns: str) -> None:
        self.run(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")

    def shape(self, ns: str, dev: str, rate_mbit: float) -> None:
        """The uplink of a host: tbf at rate_mbit on dev's egress (burst ~ 10 ms of traffic, >= 32 KiB)."""
        burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))
        self.run(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst",
                 str(burst), "latency", "200ms")

    def nat(self, ns: str, wan_dev: str, lan_devs: list[str]) -> None:
        """Masquerade LAN -> WAN; nothing new comes in from the WAN; LANs cannot reach each other."""
        self.forwarding(ns)
        ipt = lambda *a: self.run(ns, "iptables", *a)  # noqa: E731
        ipt("-t", "nat", "-A", "POSTROUTING", "-o", wan_dev, "-j", "MASQUERADE")
        ipt("-P", "FORWARD", "DROP")
        ipt("-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        for dev in lan_devs:
            ipt("-A", "FORWARD", "-i", dev, "-o", wan_dev, "-j", "ACCEPT")

    def delay_line(self, ns: str, *, delay_ms: float, loss: float, queue: int = 0, log=None) -> dict:
        """One-way delay + loss on everything `ns` forwards: netem on its egress devices when the kernel has
        it, else the NFQUEUE delay line (module docstring). Returns {"method": ...}."""
        if has_netem():
            devs = [line.split(":")[1].strip().split("@")[0] for line in
                    self.run(ns, "ip", "-o", "link", "show").stdout.splitlines() if ": lo:" not in line]
            for dev in devs:
                self.run(ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms",
                         "loss", f"{100 * loss}%")
            return {"method": "netem", "devices": devs}
        self.run(ns, "iptables", "-I", "FORWARD", "1", "-j", "NFQUEUE", "--queue-num", str(queue))
        proc = self.popen(ns, [sys.executable, "-m", "bench.netlab", "delay", "--queue", str(queue), "--delay-ms",
                               str(delay_ms), "--loss", str(loss)], stdout=log or subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline and proc.poll() is None:  # bound to the queue when it says so
            if log is not None and os.path.exists(log.name) and '"bound"' in open(log.name).read():
                break
            time.sleep(0.1)
        return {"method": "nfqueue", "pid": proc.pid}

    def popen(self, ns: str, argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self.namespaces):
            _sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()


# ---- the NFQUEUE delay line ---------------------------------------------------------------------------

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_PF_BIND, NFQNL_CFG_CMD_PF_UNBIND = 1, 3, 4
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_DROP, NF_ACCEPT = 0, 1


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _nfmsg(msg: int, queue: int, attrs: bytes, family: int = socket.AF_UNSPEC, seq: int = 0, flags: int = 0) -> bytes:
    body = struct.pack("=BBH", family, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, NLM_F_REQUEST | flags, seq, 0) + body


class NfQueue:
    """Just enough of nfnetlink_queue: bind a queue in metadata mode, read packet ids, give verdicts."""

    def __init__(self, queue: int, maxlen: int = 1 << 16):
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: bursts never overflow it
        self.sock.bind((0, 0))
        self._seq = 0
        cmd = lambda c, pf: _attr(NFQA_CFG_CMD, struct.pack("!BxH", c, pf))  # noqa: E731
        self._config(_nfmsg(NFQNL_MSG_CONFIG, 0, cmd(NFQNL_CFG_CMD_PF_UNBIND, socket.AF_INET), socket.AF_INET), True)
        self._config(_nfmsg(NFQNL_MSG_CONFIG, 0, cmd(NFQNL_CFG_CMD_PF_BIND, socket.AF_INET), socket.AF_INET), True)
        self._config(_nfmsg(NFQNL_MSG_CONFIG, queue, cmd(NFQNL_CFG_CMD_BIND, 0)))
        self._config(_nfmsg(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                            + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))
                            + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))
                            + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))))
        self.sock.setblocking(False)

    def _config(self, msg: bytes, tolerate: bool = False) -> None:
        self._seq += 1
        msg = msg[:6] + struct.pack("=H", NLM_F_REQUEST | NLM_F_ACK) + struct.pack("=I", self._seq) + msg[12:]
        self.sock.send(msg)
        reply = self.sock.recv(65536)
        length, kind = struct.unpack_from("=IH", reply)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", reply, 16)
            if err != 0 and not tolerate:
                raise NetlabError(f"nfqueue config refused: errno {-err} ({os.strerror(-err)})")

    def packet_ids(self) -> list[int]:
        """Ids of packets queued since the last call (non-blocking)."""
        ids = []
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                return ids
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if length < 16:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    a = off + 20
                    while a + 4 <= off + length:
                        alen, atype = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        if atype & 0x7FFF == NFQA_PACKET_HDR:
                            ids.append(struct.unpack_from("!I", data, a + 4)[0])
                            break
                        a += (alen + 3) & ~3
                off += (length + 3) & ~3

    def verdict(self, packet_id: int, verdict: int, batch: bool = False) -> None:
        kind = NFQNL_MSG_VERDICT_BATCH if batch else NFQNL_MSG_VERDICT
        self.sock.send(_nfmsg(kind, self.queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id))))


def run_delay_line(queue: int, delay_ms: float, loss: float, seed: int = 0) -> int:
    q = NfQueue(queue)
    rng = random.Random(seed)
    held: deque[tuple[float, int]] = deque()
    stats = {"packets": 0, "dropped": 0, "max_held": 0}
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print(json.dumps({"event": "bound", "queue": queue, "delay_ms": delay_ms, "loss": loss}), flush=True)
    delay = delay_ms / 1000.0
    last_report = time.monotonic()
    while not stop:
        timeout = max(0.0, held[0][0] + delay - time.monotonic()) if held else 0.5
        select.select([q.sock], [], [], min(timeout, 0.5))
        now = time.monotonic()
        for pid in q.packet_ids():
            held.append((now, pid))
        due = None
        while held and held[0][0] + delay <= now:
            _, pid = held.popleft()
            stats["packets"] += 1
            if rng.random() < loss:
                q.verdict(pid, NF_DROP)
                stats["dropped"] += 1
            else:
                due = pid
        if due is not None:
            q.verdict(due, NF_ACCEPT, batch=True)  # every id <= due not dropped above
        stats["max_held"] = max(stats["max_held"], len(held))
        if now - last_report > 5.0:
            last_report = now
            print(json.dumps({"event": "stats", **stats}), flush=True)
    for _, pid in held:
        q.verdict(pid, NF_ACCEPT)
    print(json.dumps({"event": "stats", "final": True, **stats}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.netlab", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("delay", help="run the NFQUEUE delay line (inside the router namespace)")
    d.add_argument("--queue", type=int, default=0)
    d.add_argument("--delay-ms", type=float, required=True)
    d.add_argument("--loss", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    sub.add_parser("check", help="can this machine build the lab? (exit 0 = yes)")
    args = p.parse_args(argv)
    if args.command == "check":
        problem = netns_problem()
        print(json.dumps({"netns": problem is None, "problem": problem, "netem": problem is None and has_netem()}))
        return 0 if problem is None else 1
    return run_delay_line(args.queue, args.delay_ms, args.loss, args.seed)


if __name__ == "__main__":
    sys.exit(main())
