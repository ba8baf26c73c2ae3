"""`asyncrl-client`: lend a GPU (or CPU) to an asyncrl swarm.

    asyncrl-client join /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...   # what the coordinator printed
    asyncrl-client status                  # contribution so far, from verified receipts
    asyncrl-client receipts --export mine.json && asyncrl-client verify mine.json --address <join address>

Heavy imports (torch, hivemind, transformers) are deferred until after argument parsing, so `--help`
answers at once and a bad address fails before anything starts.

Exit codes: 0 done · 1 error · 2 bad arguments · 3 this machine cannot serve the run's pinned base model
(the message starts with its `PinCode`, e.g. REVISION_MISMATCH; retrying will not help) · 130 aborted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "asyncrl" / "client"


def add_join_arguments(join: argparse.ArgumentParser) -> None:
    """The flags of `join` (and of `doctor`, which checks that exactly this join would work)."""
    join.add_argument("address", nargs="+",
                      help="the multiaddr the coordinator printed (ends in /p2p/<peer id>), or any peer's address "
                           "together with --coordinator; several may be given (any one that answers suffices)")
    join.add_argument("--data-dir", type=Path, default=default_data_dir(), help="identity, outbox, status, receipts")
    join.add_argument("--name", default="", help="display name shown to the operator")
    join.add_argument("--model", default=None, metavar="DIR|FILE.gguf",
                      help="local copy of the base model, a directory or the run's GGUF file (default: fetch the "
                           "manifest's pinned revision, or the named GGUF model); its content hash must match the "
                           "run's pin, or the client refuses to start")
    join.add_argument("--max-batches", type=int, default=0, help="stop after this many acked batches (0 = never)")
    join.add_argument("--prompts-per-batch", type=int, default=4,
                      help="most prompts per lease; fewer when this machine is too slow to return them in time")
    join.add_argument("--no-pipeline", dest="pipeline", action="store_false",
                      help="work in series (lease, generate, score, upload, then the next lease) instead of fetching "
                           "the next lease and uploading while the engine generates (benchmarks compare the two)")
    join.add_argument("--fixed-lease-size", action="store_true",
                      help="always ask for --prompts-per-batch, however slow this machine is (benchmarks)")
    join.add_argument("--client-mode", action="store_true",
                      help="behind NAT: do not accept incoming DHT connections (outbound only)")
    join.add_argument("--seed", type=int, default=0)
    join.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    join.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto",
                      help="auto = vLLM when CUDA and vllm are present, else transformers (says why)")
    join.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                      help="fraction of GPU memory vLLM may use (lower it if other programs need the GPU)")
    join.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                      help="cap the engine's context (prompt + completion) below the model's, e.g. to fit a small "
                           "GPU; leases that do not fit are skipped, never sent short")
    join.add_argument("--max-outbox-mb", type=int, default=512, help="disk cap for unacknowledged batches")
    join.add_argument("--duty-cycle", type=float, default=1.0, metavar="F",
                      help="lend only part of the machine: after each batch rest so that busy time / wall time "
                           "is about F (0 < F <= 1; rest = busy * (1 - F) / F)")
    join.add_argument("--hold-version", type=int, default=0, metavar="K",
                      help="EXPERIMENT ONLY (staleness benchmarks): generate with the adapter K versions behind "
                           "the newest; wastes the swarm's work otherwise (docs/staleness.md)")
    polite = join.add_argument_group("sharing the machine politely (docs/volunteer.md)")
    polite.add_argument("--only-when-idle", action="store_true",
                        help="pause (returning unfinished leases) while other processes use the GPU — or, without "
                             "an NVIDIA GPU, the CPU — or the user is at the keyboard; resume when idle")
    polite.add_argument("--user-idle-s", type=float, default=180.0, metavar="S",
                        help="with --only-when-idle: keyboard/terminal input within S seconds means in use (0 = ignore)")
    polite.add_argument("--idle-max-cpu", type=float, default=0.5, metavar="F",
                        help="with --only-when-idle and no NVIDIA GPU: other processes above this CPU share mean busy")
    polite.add_argument("--max-gpu-memory-gb", type=float, default=0.0, metavar="GB",
                        help="cap the engine's GPU memory at GB GiB (0 = --gpu-memory-utilization alone)")
    from .swarm_member import add_swarm_arguments

    add_swarm_arguments(join)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl-client", description="asyncrl volunteer client")
    sub = p.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join a swarm at ADDRESS and contribute rollouts")
    add_join_arguments(join)
    out = join.add_mutually_exclusive_group()
    out.add_argument("--quiet", action="store_true", help="only warnings and errors")
    out.add_argument("--json-logs", action="store_true", help="one JSON object per event (headless hosts)")
    join.add_argument("--follow", action="store_true",
                      help="when the coordinator's run finishes, wait for its next run instead of exiting")
    doctor = sub.add_parser("doctor", help="check whether `join ADDRESS` would work here (exit 0 = yes), with a fix "
                                           "for each failure; takes join's flags")
    add_join_arguments(doctor)
    doctor.add_argument("--json", action="store_true", help="print the rows as JSON")
    status = sub.add_parser("status", help="identity, outbox size and contribution so far (verified receipts)")
    status.add_argument("--data-dir", type=Path, default=default_data_dir())
    keys = sub.add_parser("keys", help="show (or create) this volunteer's identity key")
    keys.add_argument("--data-dir", type=Path, default=default_data_dir())
    keys.add_argument("--create", action="store_true", help="create the key if missing")
    rec = sub.add_parser("receipts", help="this volunteer's signed contribution receipts (--export: a verifiable file)")
    rec.add_argument("--data-dir", type=Path, default=default_data_dir())
    rec.add_argument("--export", type=Path, default=None, metavar="FILE",
                     help="write them to FILE (JSON) for anyone to check with `asyncrl-client verify`")
    rec.add_argument("--coordinator", default=None, metavar="PEER_ID",
                     help="only receipts signed by this coordinator (default: all)")
    for name, text in (("pause", "pause a running volunteer (returns its unfinished leases); --for limits it"),
                       ("resume", "resume a volunteer paused with `pause`")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--data-dir", type=Path, default=default_data_dir())
        if name == "pause":
            cmd.add_argument("--for", dest="duration", default="1000d", metavar="DURATION",
                             help="e.g. 90s, 30m, 2h (default: until `asyncrl-client resume`)")
    ver = sub.add_parser("verify", help="verify an exported receipts FILE offline against a join address")
    ver.add_argument("file", type=Path)
    ver.add_argument("--address", required=True, help="the run's join address (its /p2p/ peer id is the key)")
    ver.add_argument("--coordinator", default=None, metavar="PEER_ID",
                     help="the coordinator's peer id when --address is another peer's")
    ver.add_argument("--volunteer", default=None, metavar="FINGERPRINT",
                     help="require every receipt to name this volunteer key (fingerprint as `keys` prints it)")
    return p


EXIT_BASE_MISMATCH = 3


def fail(message: str, code: int = 1) -> int:
    print(f"asyncrl-client: error: {message}", file=sys.stderr)
    return code


def snooze(data_dir: Path, duration: str | None) -> int:
    """`pause` / `resume`: <data-dir>/pause.until, read by a running volunteer (client/polite.py)."""
    from asyncrl.protocol.atomic import write_atomic

    from .polite import PAUSE_NAME

    path = data_dir / PAUSE_NAME
    if duration is None:
        path.unlink(missing_ok=True)
        print(json.dumps({"paused": False}))
        return 0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = float(duration[:-1]) * units[duration[-1]] if duration[-1] in units else float(duration)
    except (ValueError, IndexError):
        return fail(f"--for {duration!r}: expected e.g. 90s, 30m, 2h", 2)
    if not data_dir.exists():
        return fail(f"no volunteer data in {data_dir}", 1)
    until = time.time() + max(0.0, seconds)
    write_atomic(path, f"{until}\n")
    print(json.dumps({"paused": True, "until": until}))
    return 0


def show_keys(data_dir: Path, *, create: bool) -> int:
    from asyncrl.protocol.errors import ProtocolError
    from asyncrl.protocol.identity import Identity

    path = data_dir / "identity.key"
    try:
        if create:
            identity, created = Identity.load_or_create(path)
        elif path.exists():
            identity, created = Identity.load(path), False
        else:
            return fail(f"no identity at {path} (run `asyncrl-client keys --create` or join once)")
    except ProtocolError as exc:
        return fail(f"{path}: {exc.detail}")
    print(json.dumps({"path": str(path), "created": created, "fingerprint": identity.fingerprint,
                      "public_key": identity.public_key.hex()}, indent=2))
    return 0


def show_status(data_dir: Path) -> int:
    from asyncrl.protocol.identity import Identity

    key = data_dir / "identity.key"
    if not key.exists():
        return fail(f"no volunteer identity in {data_dir} (has this volunteer joined yet?)")
    box = data_dir / "outbox"
    outbox = sorted([*box.glob("*.payload"), *box.glob("*.batch")]) if box.exists() else []  # (.batch: older clients)
    quarantined = sorted((box / "quarantine").glob("*.json")) if (box / "quarantine").exists() else []
    info = {"data_dir": str(data_dir), "fingerprint": Identity.load(key).fingerprint,
            "outbox_batches": len(outbox), "outbox_bytes": sum(p.stat().st_size for p in outbox),
            "outbox_quarantined": len(quarantined)}
    path = data_dir / "status.json"
    if path.exists():
        st = json.loads(path.read_text())
        info.update({"name": st.get("name"), "run_id": st.get("run_id"),
                     "last_adapter_version": (st.get("versions_loaded") or [None])[-1],
                     "adapter_versions_loaded": len(set(st.get("versions_loaded") or [])),
                     "batches_acked": st.get("batches_acked"), "batches_rejected": st.get("batches_rejected"),
                     "batches_deferred": st.get("batches_deferred"), "batches_quarantined": st.get("batches_quarantined"),
                     "rollouts": st.get("rollouts"), "tokens": st.get("tokens")})
    from .ledger import ReceiptLedger, summarise

    # What the coordinator signed for, verified here against the key in each receipt's signature
    # (`asyncrl-client verify` checks an export against the join address itself).
    info["receipts"] = summarise(ReceiptLedger(data_dir).all(), volunteer_key=Identity.load(key).public_key)
    print(json.dumps(info, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "status":
        return show_status(args.data_dir)
    if args.command == "keys":
        return show_keys(args.data_dir, create=args.create)
    if args.command == "doctor":
        from . import doctor

        return doctor.main(args)
    if args.command in ("pause", "resume"):
        return snooze(args.data_dir, args.duration if args.command == "pause" else None)
    if args.command in ("receipts", "verify"):
        from . import receipts_cli

        if args.command == "receipts":
            return receipts_cli.show_receipts(args.data_dir, export=args.export, coordinator=args.coordinator)
        return receipts_cli.verify_file(args.file, address=args.address, coordinator=args.coordinator,
                                        volunteer=args.volunteer)
    if not 0.05 <= args.gpu_memory_utilization <= 1.0:
        return fail("--gpu-memory-utilization must be in [0.05, 1.0]", 2)
    if args.max_outbox_mb < 1:
        return fail("--max-outbox-mb must be >= 1", 2)
    if not 0.0 < args.duty_cycle <= 1.0:
        return fail("--duty-cycle must be in (0, 1]", 2)
    if args.hold_version < 0:
        return fail("--hold-version must be >= 0", 2)
    if args.user_idle_s < 0 or not 0 < args.idle_max_cpu <= 1 or args.max_gpu_memory_gb < 0:
        return fail("--user-idle-s and --max-gpu-memory-gb must be >= 0, --idle-max-cpu in (0, 1]", 2)
    from asyncrl.protocol.limits import MAX_NAME_CHARS

    if len(args.name) > MAX_NAME_CHARS:  # the coordinator would refuse every request carrying it
        return fail(f"--name may hold at most {MAX_NAME_CHARS} characters (got {len(args.name)})", 2)

    from asyncrl.swarm.bootstrap import join_spec
    from asyncrl.swarm.transport import BadAddress, TransportError, check_reachable, parse_join_address

    from .checks import DOCTOR_HINT

    from .swarm_member import swarm_config

    try:
        join_spec(args.address, args.coordinator)  # a bad --coordinator fails here too
        swarm = swarm_config(args)
        check_reachable([parse_join_address(a) for a in args.address])
    except (BadAddress, ValueError) as exc:
        return fail(str(exc), 2)
    except TransportError as exc:
        return fail(f"{exc}; {DOCTOR_HINT}")

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from .worker import VolunteerConfig

    cfg = VolunteerConfig(address=args.address[0], more_addresses=tuple(args.address[1:]), data_dir=args.data_dir, name=args.name, model=args.model,
                          max_batches=args.max_batches, prompts_per_batch=args.prompts_per_batch,
                          client_mode=args.client_mode, seed=args.seed, quiet=args.quiet, engine=args.engine,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          max_outbox_bytes=args.max_outbox_mb * 1024 * 1024,
                          duty_cycle=args.duty_cycle, hold_version=args.hold_version, max_model_len=args.max_model_len,
                          follow=args.follow, fixed_lease_size=args.fixed_lease_size, pipeline=args.pipeline,
                          only_when_idle=args.only_when_idle, user_idle_s=args.user_idle_s,
                          idle_max_cpu=args.idle_max_cpu, max_gpu_memory_gb=args.max_gpu_memory_gb,
                          display="quiet" if args.quiet else "json" if args.json_logs else "live", **swarm)
    wait = 5.0
    while True:
        code, status = run_volunteer(cfg, args)
        if not args.follow or code in (2, 130) or (status is not None and not status.run_finished):
            return code
        if code == 0 and status is not None:
            wait = 5.0  # a run ended: the next Volunteer's handshake waits for the next run
        else:  # --follow and the coordinator is down between runs: try again later
            print(f"waiting {wait:.0f} s for the coordinator's next run (--follow)", flush=True)
            time.sleep(wait)
            wait = min(120.0, wait * 2)


def run_volunteer(cfg, args) -> tuple[int, object]:
    """One Volunteer from join to exit: (exit code, its VolunteerStatus or None)."""
    from asyncrl.protocol.errors import ProtocolError
    from asyncrl.swarm.transport import TransportError

    from .checks import DOCTOR_HINT
    from .engine_api import EngineUnavailable
    from .rollout import EngineFailed
    from .session import BaseModelMismatch, JoinCheckFailed, RunFinished
    from .worker import Volunteer

    try:
        vol = Volunteer(cfg)
    except ProtocolError as exc:
        return fail(f"{' '.join(args.address)!r}: {exc.detail}", 2), None

    def on_signal(signum):
        if vol.stop.is_set():
            raise KeyboardInterrupt
        print("stopping after the current batch (Ctrl-C again to abort; the outbox is kept)", flush=True)
        vol.stop.set()

    from asyncrl import signals

    signals.install(on_signal)
    try:
        vol.connect()
        print(f"joined as {vol.name} ({vol.identity.fingerprint}); run {vol.run_id}", flush=True)
        status = vol.run()
    except RunFinished as exc:
        print(f"asyncrl-client: {exc}", flush=True)
        return 0, None
    except TransportError as exc:
        return fail(f"{exc}; {DOCTOR_HINT}"), None
    except JoinCheckFailed as exc:
        return fail(f"{exc.check.code + ': ' if exc.check.code else ''}{exc}; {DOCTOR_HINT}"), None
    except ProtocolError as exc:
        return fail(f"{exc.code.value}: {exc.detail}"), None
    except KeyboardInterrupt:
        return fail("aborted; unsent batches stay in the outbox", 130), None
    except BaseModelMismatch as exc:  # "<PinCode>: what differs, what to do"; nothing was generated or sent
        return fail(str(exc), EXIT_BASE_MISMATCH), None
    except (EngineUnavailable, EngineFailed) as exc:
        return fail(str(exc)), None
    except Exception as exc:
        if exc.__class__.__name__ == "OutOfMemoryError":
            from .engine import out_of_memory_hint

            return fail(out_of_memory_hint(args.gpu_memory_utilization)), None
        return fail(f"{exc.__class__.__name__}: {exc}"), None
    finally:
        vol.shutdown()
    ended = f"run {vol.run_id!r} finished" if status.run_finished else "stopped"
    print(f"done ({ended}): {status.batches_acked} batches acked, {status.receipts} signed receipts "
          f"(`asyncrl-client status` totals them), {status.rollouts} rollouts, {status.tokens} tokens, "
          f"versions {status.versions_loaded[:1]}..{status.versions_loaded[-1:]}", flush=True)
    return 0, status


if __name__ == "__main__":
    sys.exit(main())
