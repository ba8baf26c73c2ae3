"""`asyncrl-client doctor ADDRESS [join's flags]`: would `join` work on this machine, and if not, why.

    asyncrl-client doctor /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...            # table; exit 0 = join works
    asyncrl-client doctor ... --engine vllm --data-dir /big/disk --json          # one row per check, as JSON

Rows, in this order (ids are stable; each failure carries its fix):

    versions  Python, asyncrl, protocol and schema here vs the coordinator's (its version gate answers)
    engine    torch / CUDA / vLLM, and the engine `join` would use; does it import (client/probe.py)
    memory    GPU memory (or RAM on a CPU machine) against the base model's size (meta-device param count)
    disk      free space for the outbox and, when it is not cached, the base model download
    tcp       a TCP connection to the address's host and port
    libp2p    the libp2p handshake: the peer at that address holds the peer id in the address
    pointer   the coordinator's signed pointer (from its handshake answer and from the DHT) and the
              manifest it names, both verified against the key in the address
    chunk     one adapter chunk fetched and checked against the manifest's sha256
    nat       can the coordinator dial us back (public) or not (private: --client-mode / --auto-relay)
    clock     offset from the coordinator's clock (envelope window ±300 s; the DHT tolerates 3 s)

Exit 0 only when no row failed and none was skipped (warnings pass: join works). The network rows run
against a throwaway identity — the doctor writes nothing into the data directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.swarm import hivemind_private

from .checks import FAIL, PASS, SKIP, WARN, Check, clock_check, exchange, local_versions, tcp_check, version_check

ORDER = ("versions", "engine", "memory", "disk", "tcp", "libp2p", "pointer", "chunk", "nat", "clock")
TITLES = {"versions": "versions", "engine": "engine", "memory": "GPU / RAM for the model", "disk": "free disk",
          "tcp": "TCP reach", "libp2p": "libp2p handshake + peer id", "pointer": "signed pointer + manifest",
          "chunk": "one adapter chunk", "nat": "NAT reachability", "clock": "clock offset"}
PROBE_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 15.0
KV_HEADROOM = 1.25  # weights plus room for the KV cache and activations
MIN_FREE_BYTES = 64 << 20
GiB = 1 << 30


class Doctor:
    def __init__(self, args, *, out=print):
        self.args = args
        self.out = out
        self.rows: dict[str, Check] = {}
        self.manifest = None
        self.hs = None

    # ---- network ---------------------------------------------------------------------------------
    def network(self, spec, addrs) -> None:
        for addr in addrs:  # like join: any one of the bootstrap addresses that answers suffices
            self.rows["tcp"] = tcp_check(addr)
            if self.rows["tcp"].status != FAIL:
                break
        if self.rows["tcp"].status == FAIL:
            return
        from asyncrl.swarm.transport import SwarmNode

        proto = "ip6" if ":" in self.args.host else "ip4"
        node = SwarmNode(host_maddrs=[f"/{proto}/{self.args.host}/tcp/{self.args.port}"],
                         client_mode=self.args.client_mode, use_relay=self.args.use_relay)
        try:
            if not self._libp2p(node, addr):
                return
            from asyncrl.swarm.bootstrap import rejoin

            rejoin(node, spec.bootstrap)  # into the DHT through the address, as join does
            ports = () if self.args.client_mode else _listen_ports(node)
            try:
                self.hs = exchange(node, spec.coordinator_peer_id, dial_back_ports=ports)
            except Exception as exc:
                self.rows["versions"] = Check("versions", FAIL, f"no handshake answer from the coordinator "
                                              f"{spec.coordinator_peer_id}: {exc}",
                                              "is the address (or --coordinator) the coordinator's? it may also "
                                              "run an asyncrl older than 0.2: ask the operator")
                return
            self._pointer(node, spec)
            self._nat()
        finally:
            node.shutdown()

    def _libp2p(self, node, addr) -> bool:
        from hivemind.p2p import PeerID
        from multiaddr import Multiaddr

        base = Multiaddr(addr.maddr).decapsulate(Multiaddr(f"/p2p/{addr.peer_id}"))
        try:
            node.loops.run(hivemind_private.connect(node.p2p, PeerID.from_base58(addr.peer_id), [base]),
                           timeout=CONNECT_TIMEOUT_S)
        except Exception as exc:
            text = str(exc)
            actual = re.search(r"remote key matches (\w+)", text)
            if actual:
                self.rows["libp2p"] = Check(
                    "libp2p", FAIL, f"the peer at {base} is {actual.group(1)}, not {addr.peer_id}",
                    "the address is wrong or outdated (a coordinator whose run directory was lost has a new key): "
                    "copy the exact join line the operator publishes now")
            else:
                self.rows["libp2p"] = Check("libp2p", FAIL, f"libp2p handshake with {base} failed: {text[:300]}",
                                            "is that port the coordinator's libp2p --port (not its dashboard), "
                                            "and does a firewall pass it?")
            return False
        self.rows["libp2p"] = Check("libp2p", PASS, f"{base} is {addr.peer_id[:12]}...{addr.peer_id[-6:]}")
        return True

    def _pointer(self, node, spec) -> None:
        from asyncrl.protocol import envelope, limits, messages, swarm
        from asyncrl.protocol.errors import ProtocolError, RejectCode
        from asyncrl.swarm import streams
        from asyncrl.swarm.records import install_validator
        from asyncrl.swarm.serving import chunk_request, manifest_request
        from asyncrl.swarm.streams import stream_name

        info, key, run = self.hs.info, spec.coordinator_key, self.hs.info.run_id
        mismatch_fix = ("the coordinator's adapters are not signed by the key in your address: do not join; get the "
                        "address again from the operator (an impostor, or a coordinator run with another key)")
        try:
            if not info.pointer:
                raise ProtocolError(RejectCode.INTERNAL, "the coordinator has published no adapter yet")
            pointer, _ = swarm.check_pointer(info.pointer, coordinator_key=key, run_id=run)
            raw = node.call(spec.coordinator_peer_id, stream_name(run, streams.MANIFEST), manifest_request(pointer.version),
                            max_response_bytes=limits.MAX_MANIFEST_BYTES, timeout=CONNECT_TIMEOUT_S)
            if hashlib.sha256(raw).digest() != pointer.manifest_sha256:
                raise ProtocolError(RejectCode.HASH_MISMATCH, "the manifest differs from the signed pointer")
            opened = envelope.open_envelope(raw, max_bytes=limits.MAX_MANIFEST_BYTES, expected_kind="adapter_manifest",
                                            expected_audience=envelope.BROADCAST, expected_signer=key, window_s=None)
            self.manifest = messages.decode_manifest(opened.payload)
        except ProtocolError as exc:
            fix = mismatch_fix if exc.code in (RejectCode.NOT_ALLOWED, RejectCode.SIGNATURE_MISMATCH,
                                               RejectCode.HASH_MISMATCH) else "wait for the coordinator's first adapter"
            self.rows["pointer"] = Check("pointer", FAIL, f"{exc.code.value}: {exc.detail}", fix, code=exc.code.value)
            return
        except Exception as exc:
            self.rows["pointer"] = Check("pointer", FAIL, f"manifest fetch failed: {exc}", "retry; if it persists, "
                                         "tell the operator (the coordinator does not serve its manifests)")
            return
        install_validator(node, run, spec.coordinator_peer_id)
        found = None
        for _ in range(5):  # the DHT lookup through the freshly joined routing table
            found = node.get(swarm.pointer_key(run, spec.coordinator_peer_id))
            if isinstance(found, bytes):
                break
            time.sleep(1.0)
        if not isinstance(found, bytes):
            self.rows["pointer"] = Check("pointer", FAIL, f"the coordinator signed v{pointer.version}, but the DHT "
                                         "does not return its pointer", "the DHT through this address is not working: "
                                         "try the coordinator's own address, or tell the operator")
            return
        m = self.manifest
        self.rows["pointer"] = Check("pointer", PASS, f"run {run!r} v{m.version} ({m.codec}, {m.compressed_bytes} bytes, "
                                     f"{len(m.chunk_hashes)} chunks), base {m.base_model}; signed by the address's key")
        try:
            data = node.call(spec.coordinator_peer_id, stream_name(run, streams.CHUNK), chunk_request(m.version, 0),
                             max_response_bytes=limits.MAX_CHUNK_BYTES + 64, timeout=CONNECT_TIMEOUT_S)
            if hashlib.sha256(data).digest() != m.chunk_hashes[0]:
                raise ProtocolError(RejectCode.HASH_MISMATCH, "chunk 0 does not match the manifest's sha256")
            self.rows["chunk"] = Check("chunk", PASS, f"chunk 0 of v{m.version}: {len(data)} bytes, sha256 matches")
        except Exception as exc:
            self.rows["chunk"] = Check("chunk", FAIL, f"chunk 0 of v{m.version}: {exc}",
                                       "the coordinator does not serve adapter bytes to you: tell the operator")

    def _nat(self) -> None:
        info, a = self.hs.info, self.args
        if a.client_mode:
            self.rows["nat"] = Check("nat", PASS, "client mode: outbound connections only, nobody needs to reach you")
        elif info.reachable_ports:
            self.rows["nat"] = Check("nat", PASS, f"public: the coordinator reached {info.observed_addr or 'you'} back "
                                     f"on port {info.reachable_ports[0]}")
        elif a.use_auto_relay or a.relays:
            self.rows["nat"] = Check("nat", PASS, "private, but --auto-relay makes you reachable through a relay")
        else:
            self.rows["nat"] = Check("nat", WARN, f"private: the coordinator sees you at {info.observed_addr or '?'} "
                                     "and cannot connect back (NAT or firewall)",
                                     "join works outbound; add --client-mode (outbound only), or --auto-relay to "
                                     "serve adapters to others through a relay, or forward a port: --port P "
                                     "--announce /ip4/<public ip>/tcp/P")

    # ---- this machine ----------------------------------------------------------------------------
    def machine(self) -> None:
        model = self.args.model or (self.manifest.base_model if self.manifest is not None else None)
        cmd = [sys.executable, "-m", "asyncrl.client.probe", "--engine", self.args.engine]
        if model:
            cmd += ["--model", model]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
            probe = json.loads(done.stdout.strip().splitlines()[-1])
        except Exception as exc:
            for rid in ("engine", "memory"):
                self.rows[rid] = Check(rid, FAIL, f"the machine probe failed: {exc}", "reinstall asyncrl "
                                       "in this Python environment (the coordinator's wheel, or pip install -e . in a "
                                       "clone at its commit: docs/gpu-swarm.md)")
            probe = {}
        else:
            self.rows["engine"] = _engine_row(probe["engine"], self.args.engine)
            self.rows["memory"] = _memory_row(probe, self.args)
        self.rows["disk"] = _disk_row(self.args, probe.get("model", {}) if probe else {}, model)
        if "versions" not in self.rows or self.rows["versions"].status == SKIP:
            self.rows["versions"] = version_check(self.hs, local=local_versions())

    # ---- all of it -------------------------------------------------------------------------------
    def run(self) -> list[Check]:
        from asyncrl.swarm.bootstrap import join_spec
        from asyncrl.swarm.transport import parse_join_address

        spec = join_spec(self.args.address, self.args.coordinator)  # BadAddress: the caller's exit 2
        self.network(spec, [parse_join_address(a) for a in self.args.address])
        if self.hs is not None and "versions" not in self.rows:
            self.rows["versions"] = version_check(self.hs, local=local_versions())
        if self.hs is not None:
            self.rows["clock"] = clock_check(self.hs)
        self.machine()
        after = {"libp2p": "tcp", "pointer": "libp2p", "chunk": "pointer", "nat": "libp2p", "clock": "libp2p"}
        for rid in ORDER:
            if rid not in self.rows:
                self.rows[rid] = Check(rid, SKIP, f"not checked: {TITLES[after.get(rid, 'tcp')]} failed")
        return [self.rows[rid] for rid in ORDER]


def _listen_ports(node) -> tuple[int, ...]:
    ports = []
    for m in node.visible_maddrs():
        hit = re.search(r"/tcp/(\d+)", m)
        if hit and int(hit.group(1)) not in ports:
            ports.append(int(hit.group(1)))
    return tuple(ports[:2])


def _engine_row(engine: dict, requested: str) -> Check:
    chosen, reason = engine.get("chosen"), engine.get("reason", "")
    if not engine.get("ok"):
        if chosen == "vllm":
            fix = ("install vLLM built for this machine's CUDA (pip install 'vllm>=0.10.2'), or use "
                   "--engine transformers (much slower)")
        else:
            fix = ("reinstall the dependencies: the coordinator's asyncrl wheel or pip install -e . in a clone "
                   "(torch first for GPU builds: docs/gpu-swarm.md)")
        return Check("engine", FAIL, f"--engine {requested}: {chosen or 'none'} does not import: {engine.get('error')}",
                     fix)
    why = f" (vLLM not used: {reason})" if chosen == "transformers" and requested == "auto" else ""
    detail = f"join would generate with {chosen} {engine.get('version', '')}{why}"
    if chosen == "transformers" and requested == "auto" and "CUDA" in reason:
        return Check("engine", PASS, detail + "; fine for the tiny model, too slow for real ones")
    return Check("engine", PASS, detail)


def _memory_row(probe: dict, args) -> Check:
    model = probe.get("model") or {}
    if "params" not in model:
        return Check("memory", WARN, f"base model size unknown: {model.get('error', 'no model')}",
                     "doctor cannot size it before the model is in the Hugging Face cache; join will download it")
    params = model["params"]
    gpus = probe.get("gpus") or []
    if probe.get("cuda") and gpus:
        gpu = gpus[0]
        cap = gpu["total_bytes"] * args.gpu_memory_utilization
        limit = getattr(args, "max_gpu_memory_gb", 0) or 0
        if limit:
            cap = min(cap, limit * GiB)
        need = params * 2 * KV_HEADROOM  # bf16 weights + KV cache headroom
        what = f"{model['ref']}: {_count(params)} parameters need ~{need / GiB:.1f} GiB; {gpu['name']} lends {cap / GiB:.1f} GiB"
        if need > cap:
            return Check("memory", FAIL, what, "use a smaller model or a bigger GPU, or raise --gpu-memory-utilization "
                                               "/ --max-gpu-memory-gb if the GPU is otherwise free")
        if gpu["free_bytes"] < cap:
            return Check("memory", WARN, what + f", but only {gpu['free_bytes'] / GiB:.1f} GiB are free now",
                         "other programs hold GPU memory: close them or lower --gpu-memory-utilization")
        return Check("memory", PASS, what)
    mem = probe.get("memory") or {}
    need = params * 4 * KV_HEADROOM  # fp32 on CPU
    what = f"{model['ref']}: {_count(params)} parameters need ~{need / GiB:.2f} GiB of RAM (CPU, fp32)"
    if mem.get("MemTotal") and need > mem["MemTotal"]:
        return Check("memory", FAIL, what + f"; this machine has {mem['MemTotal'] / GiB:.1f} GiB",
                     "a real model needs a GPU: join from a machine with CUDA")
    if mem.get("MemAvailable") and need > mem["MemAvailable"]:
        return Check("memory", WARN, what + f"; {mem['MemAvailable'] / GiB:.1f} GiB are available now",
                     "close other programs first")
    return Check("memory", PASS, what)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _disk_row(args, model: dict, ref: str | None) -> Check:
    data_dir = Path(args.data_dir)
    probe_dir = data_dir if data_dir.exists() else next((p for p in data_dir.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(probe_dir).free
    outbox = args.max_outbox_mb << 20
    download = 0
    if ref and "params" in model and not Path(ref).exists() and not ref.startswith("asyncrl/"):
        cache = _hf_cache()
        if not _in_hf_cache(ref):
            download = model["params"] * 2
            free = min(free, shutil.disk_usage(cache if cache.exists() else Path("/")).free)
    what = f"{free / GiB:.1f} GiB free for the outbox (cap {args.max_outbox_mb} MB)" + (
        f" and the model download (~{download / GiB:.1f} GiB)" if download else "")
    if free < MIN_FREE_BYTES + download:
        return Check("disk", FAIL, what, "free some disk space, or point --data-dir / HF_HOME at a bigger disk")
    if free < outbox + download:
        return Check("disk", WARN, what, f"lower --max-outbox-mb below {max(1, (free - download) >> 20)} or free space")
    return Check("disk", PASS, what)


def _hf_cache() -> Path:
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except Exception:
        return Path.home() / ".cache" / "huggingface" / "hub"


def _in_hf_cache(ref: str) -> bool:
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(ref, local_files_only=True)
        return True
    except Exception:
        return False


# ---- presentation ----------------------------------------------------------------------------------

MARK = {PASS: "ok", WARN: "warn", FAIL: "FAIL", SKIP: "skip"}


def render(rows: list[Check]) -> str:
    width = max(len(TITLES[r.id]) for r in rows)
    lines = [f"{'check'.ljust(width)}  status  detail"]
    for r in rows:
        lines.append(f"{TITLES[r.id].ljust(width)}  {MARK[r.status].ljust(6)}  {r.detail}")
        if r.fix and r.status in (FAIL, WARN):
            lines.append(f"{''.ljust(width)}  {'':6}  fix: {r.fix}")
    return "\n".join(lines)


def exit_status(rows: list[Check]) -> int:
    return 0 if all(r.status in (PASS, WARN) for r in rows) else 1


def main(args) -> int:
    from asyncrl.swarm.transport import BadAddress

    t0 = time.time()
    try:
        rows = Doctor(args).run()
    except (BadAddress, ValueError) as exc:
        print(f"asyncrl-client: error: {exc}", file=sys.stderr)
        return 2
    status = exit_status(rows)
    if args.json:
        print(json.dumps({"ok": status == 0, "seconds": round(time.time() - t0, 1),
                          "rows": [r.as_dict() for r in rows]}, indent=1))
    else:
        print(render(rows))
        print("join would work" if status == 0 else "join would not work: see the fixes above", flush=True)
    return status
