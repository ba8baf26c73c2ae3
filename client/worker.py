"""Volunteer hub: join, follow the adapter, generate, score, sign, spool, upload.

Components (one job each; none references this hub):
  SwarmNode    (asyncrl.swarm.transport)  hivemind DHT + P2P streams to the coordinator
  AdapterSync  watch the signed pointer, fetch + verify + decode adapter versions
  Engine       generation with per-token sampling logprobs (transformers; vLLM plugs in here)
  Outbox       batch payloads on disk until acked (client/outbox.py); sealed afresh at each upload
  ReceiptLedger (client/ledger.py) each ack's coordinator-signed receipt, verified, append-only
  LeaseSizer   (client/lease_sizing.py) prompts per lease from this machine's measured rate
  IdleWatch    (client/polite.py) --only-when-idle / `asyncrl-client pause`: pause, returning unfinished leases
  status.json  what this volunteer did (for `asyncrl-client status` and tests)

  LeaseRpc     (client/lease_rpc.py) the one lease-stream call: ask, renew, return, goodbye
  pipeline     (client/pipeline.py) LeaseAhead / Stage / Uploader: the threads that keep the engine busy

Loop (the engine thread): poll the pointer (hot-swap a newer adapter between batches) -> take the leases
fetched ahead (and ask for the next ones) -> generate G completions each, all prompts in one engine call
-> hand the work to the scorer thread (score -> spool the RolloutBatch payload), whose spool wakes the
uploader thread (seal with a fresh timestamp + nonce -> upload -> delete on ack). `--no-pipeline` runs the
same steps in series on one thread (benchmarks compare the two). What each answer does to a spooled batch (`UPLOAD_OUTCOMES`, docs/client.md): acked or
duplicate -> deleted; busy / clock / deadline -> kept, the flush stops and retries later; refused after the
coordinator read it -> deleted and counted; too large -> split by groups (or quarantined when it is one
group); a coordinator that cannot take it at all (not admitted, other run, other schema) -> quarantined.

    asyncrl-client join /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from asyncrl.protocol import envelope, limits, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity
from asyncrl.swarm import streams
from asyncrl.swarm.streams import stream_name

from .episodes import episode_completion, generate_episodes, is_episode_lease

MAX_BACKOFF_S = 30.0  # outbox full: longest wait for uploads to make room
ENGINE_FAILURE_STREAK = 3  # works in a row in which the engine served no lease at all: the engine is broken
FOLLOW_FIRST_WAIT_S, FOLLOW_MAX_WAIT_S = 5.0, 120.0  # --follow: how often to ask for the next run

SEAL_OVERHEAD = 256  # envelope header + body framing around a payload (bytes, generous)
MAX_INTERNAL_RETRIES = 5  # a batch the coordinator keeps failing on (INTERNAL) is quarantined after this


def _codes(*codes: RejectCode) -> frozenset[str]:
    return frozenset(c.value for c in codes)


# What an upload's answer does to the spooled batch. Sealing happens at upload, so EXPIRED / NONCE_REUSED
# only mean "try again with a fresh seal" (a clock off by more than the window: say so, keep the batch).
RETRY_LATER = _codes(RejectCode.RATE_LIMITED, RejectCode.EXPIRED, RejectCode.NONCE_REUSED,
                     RejectCode.DEADLINE_EXCEEDED)  # keep it; stop this flush; back off
RETRY_BATCH = _codes(RejectCode.INTERNAL, RejectCode.UNSCORABLE)  # keep it at the back of the line; go on
QUARANTINE = _codes(RejectCode.NOT_ALLOWED, RejectCode.UNSUPPORTED_VERSION, RejectCode.WRONG_RUN,
                    RejectCode.WRONG_AUDIENCE)  # the coordinator could not judge it: set aside, never deleted
SPLIT = _codes(RejectCode.PAYLOAD_TOO_LARGE)  # split by groups and re-spool; one group: quarantine
# Everything else (STALE_VERSION, UNKNOWN_LEASE, REWARD_MISMATCH, ...) means the coordinator read the batch
# and refused it for good: the spooled copy is deleted and the code counted.
FINAL_REJECTS = frozenset(c.value for c in RejectCode) - RETRY_LATER - RETRY_BATCH - QUARANTINE - SPLIT - \
    _codes(RejectCode.DUPLICATE_BATCH)
# A lease refused with these ends the volunteer's run: asking again can never succeed.
FINAL_LEASE_REJECTS = {RejectCode.UNSUPPORTED_VERSION, RejectCode.NOT_ALLOWED, RejectCode.TOO_SLOW}
MAX_SIZES_KEPT = 64  # status.json keeps this many recent lease sizes
PAUSE_POLL_S = 2.0  # paused: how often to look whether the machine is free again
RELEASE_RETRY_S = 1.0  # a release whose answer was lost is sent once more after this


@dataclass
class VolunteerConfig:
    address: str
    data_dir: Path
    name: str = ""
    model: str | None = None  # override the manifest's base model (e.g. a local copy)
    max_batches: int = 0  # 0 = unlimited
    prompts_per_batch: int = 4
    poll_s: float = 0.5
    seed: int = 0
    client_mode: bool = False
    quiet: bool = False
    engine: str = "auto"  # auto | vllm | transformers
    gpu_memory_utilization: float = 0.85
    display: str = "plain"  # live | plain | json | quiet
    max_outbox_bytes: int = 512 * 1024 * 1024
    duty_cycle: float = 1.0  # 0 < F <= 1: rest after each batch so busy / wall ~ F (client/pacing.py)
    max_model_len: int | None = None  # cap the engine's context (prompt + completion); None = the model's
    hold_version: int = 0  # EXPERIMENT-ONLY: generate with the adapter K versions behind (client/version_hold.py)
    follow: bool = False  # when the run is over, wait for the coordinator's next run instead of exiting
    fixed_lease_size: bool = False  # always ask for prompts_per_batch (no sizing: benchmarks, comparisons)
    pipeline: bool = True  # fetch the next lease, score and upload while the engine generates (client/pipeline.py)
    # polite mode (client/polite.py)
    only_when_idle: bool = False  # pause while other processes use the GPU (or CPU) or the user is active
    user_idle_s: float = 180.0  # user input this recently counts as "in use" (0 = ignore the user)
    idle_max_cpu: float = 0.5  # other processes' CPU share that counts as busy on a machine without NVIDIA
    max_gpu_memory_gb: float = 0.0  # cap on the engine's GPU memory (0 = --gpu-memory-utilization alone)
    # swarm (client/swarm_member.py, docs/transport.md)
    coordinator: str | None = None  # coordinator peer id when `address` is another peer's (bootstrap only)
    more_addresses: tuple[str, ...] = ()  # further bootstrap addresses: any one that answers suffices
    serve: bool = True  # re-serve held adapter versions to other volunteers (off in client mode)
    max_upload_bps: int = 0  # cap on adapter bytes served to peers per second; 0 = unlimited
    host: str = "127.0.0.1"  # listen address (the CLI's default is 0.0.0.0, so other volunteers reach us)
    port: int = 0
    announce: tuple[str, ...] = ()
    use_relay: bool = True
    use_auto_relay: bool = False
    relays: tuple[str, ...] = ()


@dataclass
class VolunteerStatus:
    name: str
    fingerprint: str
    versions_loaded: list[int] = field(default_factory=list)
    batches_sent: int = 0
    batches_acked: int = 0
    batches_rejected: dict[str, int] = field(default_factory=dict)  # refused for good (deleted), by code
    batches_deferred: dict[str, int] = field(default_factory=dict)  # answered "later" (kept), by code
    batches_quarantined: int = 0  # set aside in outbox/quarantine (too large, not admitted, ...)
    batches_split: int = 0        # too large for the coordinator's cap: split by groups
    env_errors: int = 0           # multi-turn leases whose environment raised or hung here (lease abandoned)
    groups_unscorable: int = 0    # our own reward check could not finish: group not sent (lease expires)
    rollouts: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    started_at: float = field(default_factory=time.time)
    busy_s: float = 0.0    # measured batch work time (--duty-cycle accounting)
    engine_busy_s: float = 0.0  # time inside the engine's generate (engine_busy_fraction = this / wall)
    rested_s: float = 0.0  # time rested for the duty cycle
    idle_lease_requests: int = 0  # lease requests answered with no work (client/pacing.py IdleBackoff)
    lease_renewals: int = 0   # renewal requests answered while generating (client/lease_keeper.py)
    leases_abandoned: int = 0  # leases given up (their groups not sent), of which:
    leases_too_long: int = 0   #   prompt + max_new_tokens beyond this engine's context
    engine_errors: int = 0     #   the engine raised on that prompt
    reward_errors: int = 0     #   the reward function raised or returned something unusable
    leases_lost: int = 0       #   the coordinator said it had expired
    receipts: int = 0          # verified receipts added to the ledger (client/ledger.py)
    receipts_missing: int = 0  # acks that came without one (an older coordinator, or its disk failed)
    receipts_invalid: int = 0  # receipts that did not verify against the join address (never kept)
    run_finished: bool = False  # the coordinator ended the run (signed pointer / RUN_FINISHED): we stopped
    lease_sizes: list[int] = field(default_factory=list)  # prompts granted per lease, newest last (client/lease_sizing.py)
    seconds_per_prompt: float = 0.0  # measured, grant to ack (or to the lease's loss)
    refused: str = ""  # the code that ended this volunteer's run (TOO_SLOW, NOT_ALLOWED, UNSUPPORTED_VERSION)
    state: str = "starting"  # starting | working | generating | paused
    lease_progress: list[int] = field(default_factory=list)  # [prompts done, prompts leased] while generating
    pause_reason: str = ""
    paused_s: float = 0.0  # time paused by polite mode or `asyncrl-client pause`
    leases_returned: int = 0  # unfinished leases given back on a pause (instead of letting them expire)
    canary: dict = field(default_factory=dict)  # the last adapter-identity check (models/canary.py)
    canary_failures: int = 0  # versions refused because the engine did not match the coordinator's canary


@dataclass
class Work:
    """Leases granted together, on their way through the pipeline (client/pipeline.py)."""
    leases: list
    keeper: object  # LeaseKeeper renewing them since the grant (None for an empty grant)
    granted_at: float  # monotonic
    retry_after: float = 0.0  # an empty grant: the coordinator's waiting line
    version: int = -1  # the adapter it was generated with
    generated: list = field(default_factory=list)  # (lease, samples)
    unfinished: list = field(default_factory=list)  # leases a pause left unstarted (returned)
    reason: str | None = None


@dataclass
class PendingAck:
    """A spooled batch's leases: when they were granted, how many prompts were tried (the sizer's sample)."""
    prompts: int
    granted_at: float
    measured: bool = False


class EngineFailed(RuntimeError):
    """The engine failed every lease of several works in a row: it is broken, not one prompt."""


def engine_dtype(engine) -> str:
    """The wire name of the dtype an engine computes logprobs in ("" when it does not say)."""
    name = str(getattr(engine, "dtype", "")).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, "")


def engine_kind(engine) -> str:
    """The wire name of an engine's kind (its `name`: "transformers", "vllm"; "" when it has none or one the
    wire cannot carry): the coordinator learns an audit tolerance per kind and dtype."""
    name = str(getattr(engine, "name", "")).lower()
    return name if 0 < len(name) <= 32 and all(c.isalnum() or c in "_.-" for c in name) and name.isascii() else ""


def engine_sizing(engine, manifest: messages.AdapterManifest, *, capped_by_user: bool) -> str:
    """The line `join` prints once its engine runs: the context it serves and why, how many sequences it runs
    at once, and its KV cache (what a volunteer checks when batches look small or memory looks wasted)."""
    context = getattr(engine, "context_limit", None)
    why = ("--max-model-len" if capped_by_user else "the task's longest prompt + max_new_tokens"
           if manifest.max_context_tokens else "the model's own limit")
    parts = [f"engine: {getattr(engine, 'name', '?')}, context {context} tokens ({why})"]
    seqs, kv = getattr(engine, "max_num_seqs", 0), getattr(engine, "kv_cache_tokens", 0)
    if seqs:
        parts.append(f"up to {seqs} sequences at once")
    if kv and context:
        parts.append(f"KV cache {kv} tokens = {kv // context} full-length sequences")
    return ", ".join(parts)


class BaseModelMismatch(RuntimeError):
    """This volunteer cannot serve the run's base model: `.code` is a `models.pinning.PinCode` value (stable),
    the message says what differs and what to do. Raised before anything is generated or sent."""

    def __init__(self, code: str, detail: str):
        self.code = str(code)
        self.detail = detail
        super().__init__(f"{self.code}: {detail}")


class RunFinished(RuntimeError):
    """The coordinator's run is over (its handshake says so): nothing to do until the next one (--follow)."""


class JoinCheckFailed(RuntimeError):
    """One of join's cheap checks failed (client/checks.py); `.check` is the row (id, detail, fix, code)."""

    def __init__(self, check):
        super().__init__(f"{check.detail}; {check.fix}" if check.fix else check.detail)
        self.check = check


class Volunteer:
    def __init__(self, cfg: VolunteerConfig, *, out=None):
        from asyncrl.swarm.transport import parse_join_address

        from .display import Display

        self.cfg = cfg
        self.display = Display(cfg.display)
        self.out = out or (lambda message: self.display.event("info", message))
        self.stop = threading.Event()
        self.addr = parse_join_address(cfg.address)  # BadAddress before anything starts
        from asyncrl.swarm.bootstrap import join_spec

        self.join = join_spec([cfg.address, *cfg.more_addresses], cfg.coordinator)  # whose key we trust
        self.coordinator_peer_id = self.join.coordinator_peer_id
        self.coordinator_key = self.join.coordinator_key
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity, created = Identity.load_or_create(cfg.data_dir / "identity.key")
        if created:
            self.out(f"created volunteer identity {self.identity.fingerprint} in {cfg.data_dir / 'identity.key'}")
        self.name = cfg.name or f"volunteer-{self.identity.fingerprint[:9].replace(':', '')}"
        from .outbox import Outbox

        self.outbox = Outbox(cfg.data_dir / "outbox", max_bytes=cfg.max_outbox_bytes)
        from .ledger import ReceiptLedger

        self.ledger = ReceiptLedger(cfg.data_dir)
        self.status = VolunteerStatus(name=self.name, fingerprint=self.identity.fingerprint)
        self.run_id: str | None = None
        self.latest_version: int | None = None
        from .lease_sizing import LeaseSizer

        self.sizer = LeaseSizer(cfg.prompts_per_batch, fixed=cfg.fixed_lease_size)  # work sized to this machine
        self.granted_at = 0.0
        from .polite import IdleWatch

        self.polite = IdleWatch(cfg.data_dir, only_when_idle=cfg.only_when_idle, user_idle_s=cfg.user_idle_s,
                                cpu_busy_fraction=cfg.idle_max_cpu)
        if cfg.only_when_idle:
            self.out(f"[{self.name}] --only-when-idle: pausing while any of these say busy: "
                     + ", ".join(self.polite.detectors()))
        self.max_batch_bytes = 0  # the coordinator's cap, from its last lease grant (0 = not known yet)
        self._internal_failures: dict[bytes, int] = {}
        # the pipeline (client/pipeline.py): shared by the engine, scorer and uploader threads
        self._counter_lock, self._flush_lock, self._status_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._awaiting_ack: dict[bytes, PendingAck] = {}  # spooled batch id -> its leases' grant (sizing)
        self._settled = threading.Event()  # an upload was answered
        self._uploader = None
        from .pacing import ReconnectBackoff

        self._upload_retry = ReconnectBackoff()  # the uploader's waits after a failed or deferred flush
        self._lease_retry = ReconnectBackoff()  # the lease loop's, after a call that reached no coordinator
        self.canary_refused: int | None = None  # a version whose canary failed: no work until a newer one passes
        self._canary_report = None  # a passed canary, said with the next lease request
        if self.outbox.migrated:
            self.out(f"converted {self.outbox.migrated} spooled batches from an older client to payloads")

    # ---- start-up ---------------------------------------------------------------------------
    def connect(self, run_id: str | None = None, timeout: float = 60.0) -> None:
        from asyncrl.swarm.transport import check_reachable, parse_join_address

        from .adapter_sync import AdapterSync

        check_reachable([parse_join_address(a) for a in self.join.bootstrap])
        from .swarm_member import SwarmMembership, open_node

        self.node = open_node(bootstrap=self.join.bootstrap, data_dir=self.cfg.data_dir, identity=self.identity,
                              client_mode=self.cfg.client_mode, host=self.cfg.host, port=self.cfg.port,
                              announce=self.cfg.announce, use_relay=self.cfg.use_relay,
                              use_auto_relay=self.cfg.use_auto_relay, relays=self.cfg.relays)
        self.handshake = self._handshake()  # versions (the gate), run state, clock: before any work
        self.run_id = run_id or self.handshake.info.run_id
        self.sync = AdapterSync(self.node, coordinator_peer_id=self.coordinator_peer_id,
                                coordinator_key=self.coordinator_key, run_id=self.run_id)
        self.swarm = SwarmMembership(  # validator, serving, presence, background following, re-dialling
            self.node, identity=self.identity, sync=self.sync, run_id=self.run_id, name=self.name,
            bootstrap=self.join.bootstrap, serve=self.cfg.serve and not self.cfg.client_mode,
            upload_bps=self.cfg.max_upload_bps, out=self.out,
            snapshot=lambda: {"adapter_version": getattr(self, "serving_version", -1),
                              "throughput": self.status.rollouts / max(1.0, time.time() - self.status.started_at)},
        ).start()
        from .pacing import DutyCycle, IdleBackoff
        from .version_hold import HeldAdapters

        self.pacer = DutyCycle(self.cfg.duty_cycle)
        self.idle = IdleBackoff(self.cfg.poll_s)
        self.hold = HeldAdapters(self.sync, self.cfg.hold_version) if self.cfg.hold_version else None

    def _handshake(self):
        """`asyncrl.info` (client/checks.py): refuse to start when the gate, the run state or the clock say no."""
        from .checks import FAIL, WARN, cheap_join_checks

        hs, checks = cheap_join_checks(self.node, self.coordinator_peer_id)
        while hs.info.finished and self.cfg.follow and not self.stop.is_set():
            hs, checks = self._wait_for_next_run(hs)
        if hs.info.finished:
            raise RunFinished(f"run {hs.info.run_id!r} has finished; nothing to do (`join --follow` waits for the next)")
        for check in checks:
            if check.status == FAIL:
                if check.code == RejectCode.REWARD_PACKAGE_MISSING.value:
                    self._report_missing_rewards(hs)
                raise JoinCheckFailed(check)
            if check.status == WARN:
                self.display.event("warning", f"warning: {check.detail}; {check.fix}")
        return hs

    def _report_missing_rewards(self, hs) -> None:
        """Say which reward packages we lack before we leave, so the operator sees it on the dashboard (no
        lease was asked for; the refusal is no strike). Best effort: we leave either way."""
        from .checks import exchange, missing_reward_packages

        try:
            exchange(self.node, self.coordinator_peer_id,
                     missing_rewards=tuple(p.reward for p in missing_reward_packages(hs.info)))
        except Exception as exc:  # noqa: BLE001 - the refusal stands whether or not the report arrived
            self.display.event("warning", f"could not tell the coordinator about the missing packages: {exc}")

    def _wait_for_next_run(self, hs):
        """--follow: ask the coordinator again, less and less often, until it runs an unfinished run."""
        from asyncrl.swarm.bootstrap import rejoin

        from .checks import cheap_join_checks

        wait = FOLLOW_FIRST_WAIT_S
        self.display.event("info", f"run {hs.info.run_id!r} has finished; waiting for the next one (--follow)")
        while not self.stop.wait(wait):
            wait = min(FOLLOW_MAX_WAIT_S, wait * 2)
            try:
                rejoin(self.node, self.join.bootstrap)  # it may have restarted
                hs, checks = cheap_join_checks(self.node, self.coordinator_peer_id)
            except Exception:  # down between runs: keep waiting
                continue
            if not hs.info.finished:
                return hs, checks
        return hs, []

    def wait_for_adapter(self, timeout: float | None = None, *, report_every_s: float = 60.0):
        """The first adapter version, fetched in the background by the follower. `join` waits for it until
        stopped (a coordinator still starting, a slow network or a loaded machine is not a reason for an
        honest volunteer to quit: a fixed limit makes one exit on a loaded machine), saying every
        `report_every_s` that it is still waiting. None when stopped first; `timeout` (benches) raises."""
        started = time.time()
        reported = started
        while not self.stop.is_set():
            got = self.sync.poll()
            if got is not None:
                return got
            now = time.time()
            if timeout is not None and now - started > timeout:
                raise TimeoutError("no adapter published by the coordinator yet")
            if now - reported >= report_every_s:
                reported = now
                self.out(f"[{self.name}] still waiting for the coordinator's first adapter ({now - started:.0f} s; "
                         "Ctrl-C stops; `asyncrl-client doctor <address>` checks the path)")
            self.stop.wait(self.cfg.poll_s)
        return None

    def load_engine(self, manifest: messages.AdapterManifest):
        """Find exactly the base model the manifest pins (models/pinning.py), verify it, then start the engine."""
        from asyncrl.models.pinning import PinError, locate, pin_of

        from .engine import make_engine

        pin = pin_of(manifest)
        try:
            base = locate(pin, override=self.cfg.model)
        except PinError as exc:
            raise BaseModelMismatch(exc.code.value, exc.detail) from None
        if not self.cfg.quiet:
            self.out(f"base model {pin.name} at {pin.short()} verified ({base.path})")
        # the task's longest sequence (manifest), not the model's whole context: that memory goes to batch
        context = self.cfg.max_model_len or manifest.max_context_tokens or None
        self.engine = make_engine(self.cfg.engine, base.path, manifest.lora, seed=self.cfg.seed,
                                  gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                                  max_gpu_memory_gb=self.cfg.max_gpu_memory_gb,  # the engine's own budget
                                  max_model_len=context, stop_token_ids=pin.stop_token_ids,
                                  out=self.out)
        self.out(engine_sizing(self.engine, manifest, capped_by_user=bool(self.cfg.max_model_len)))
        self.model_name = base.path
        self.sizer.engine_seqs = int(getattr(self.engine, "max_num_seqs", 0) or 0)  # leases that fill the engine

    # ---- main loop (the engine thread; client/pipeline.py) --------------------------------------
    def run(self) -> VolunteerStatus:
        from asyncrl.swarm.transport import TransportError

        from .outbox import OutboxFull
        from .pipeline import LeaseAhead, Stage, Uploader

        if getattr(self, "engine", None) is None:  # first run(); a later call continues with what it has
            current = self.wait_for_adapter()
            if current is None:  # stopped (SIGTERM/Ctrl-C) before the coordinator published anything
                return self.status
            self.load_engine(current.manifest)
            self._load(current)
        backoff = 1.0
        try:
            self.flush()  # batches left from a previous run go first
        except TransportError as exc:
            self.display.event("warning", f"could not upload spooled batches yet ({exc}); will retry")
        pipelined = self.cfg.pipeline
        # --only-when-idle generates prompt by prompt and gives the machine back at once: no lease ahead there
        ahead = LeaseAhead(self._fetch_work) if pipelined and not self.cfg.only_when_idle else None
        stage = Stage(self._finish_work, depth=1, name="scorer") if pipelined else None
        self._uploader = Uploader(self.flush, on_error=self._upload_failed) if pipelined else None
        try:
            while not self.stop.is_set() and not self.status.run_finished:
                if self.cfg.max_batches and self.status.batches_acked >= self.cfg.max_batches:
                    break
                try:
                    if len(self.outbox):
                        # Spooled batches go first, every round (not only after new work: a volunteer holding
                        # all the leases it may hold would otherwise never deliver them after an outage), and
                        # before the --max-batches wait below, which waits for exactly these uploads.
                        self._kick_uploads()
                    in_flight = self._in_flight(stage)
                    if self.cfg.max_batches and self.status.batches_acked + in_flight >= self.cfg.max_batches:
                        self._settled.clear()  # enough work is out: wait for its acks (or refusals)
                        self._settled.wait(self.cfg.poll_s)
                        continue
                    newer = self.sync.poll()
                    if newer is not None:
                        self._load(newer)
                    if self.sync.finished:  # the coordinator's signed pointer: the run is over
                        self.status.run_finished = True
                        self._goodbye()
                        break
                    if len(self.outbox) and self.outbox.size_bytes() >= self.outbox.max_bytes * 0.9:
                        # Bounded disk: stop producing until the coordinator takes what we have.
                        self.display.event("warning", f"outbox nearly full ({self.outbox.size_bytes()} bytes, cap "
                                           f"{self.outbox.max_bytes}); pausing generation until uploads succeed")
                        self.stop.wait(backoff)
                        backoff = min(MAX_BACKOFF_S, backoff * 2)
                        continue
                    if self.canary_refused is not None:  # the engine did not really load it: wait for a newer one
                        self._return_ahead(ahead, f"adapter v{self.canary_refused} failed its canary")
                        if self.status.state != "refused":
                            self.status.state = "refused"
                            self._write_status()
                        self.stop.wait(self.cfg.poll_s)
                        continue
                    reason = self.polite.busy()  # --only-when-idle / `asyncrl-client pause`
                    if reason is not None:
                        self._return_ahead(ahead, reason)
                        self._pause(reason)
                        continue
                    self.status.state = "working"
                    work = ahead.take() if ahead is not None and ahead.asked else self._fetch_work()
                    self._lease_retry.reset()  # the coordinator answered
                    if not work.leases:
                        if work.retry_after > 0:  # the coordinator's waiting line (client/pacing.py IdleBackoff)
                            self.stop.wait(self.idle.after_empty(work.retry_after))
                        elif self.hold is None and (self.latest_version or 0) > self.serving_version:
                            # --sync grants only at the current version: look again soon, it is being fetched
                            self.idle.requests += 1
                            time.sleep(min(self.cfg.poll_s, 0.05))
                        else:
                            self.stop.wait(self.idle.after_empty(0.0))
                        self.status.idle_lease_requests = self.idle.requests
                        continue
                    self.idle.reset()
                    if ahead is not None and self._worth_asking_ahead(in_flight):
                        ahead.ask()  # the next prompts, fetched while this generation runs
                    busy = self._generate_work(work)
                    if stage is not None:
                        stage.put(work)  # blocks while the scorer is a work behind (back-pressure)
                    else:  # the serial loop (--no-pipeline): score, spool, upload, then the next lease
                        self._finish_work(work)  # (its spool flushes at once)
                    self.pacer.rest_after(busy, self.stop)  # --duty-cycle (no-op at 1.0)
                    self.status.busy_s, self.status.rested_s = self.pacer.busy_s, self.pacer.rested_s
                    backoff = 1.0
                except ProtocolError as exc:
                    if exc.code is RejectCode.RUN_FINISHED:
                        self.status.run_finished = True
                        break
                    if exc.code in FINAL_LEASE_REJECTS:  # no retry can help: say so and stop (cli.py prints it)
                        self.status.refused = exc.code.value
                        self._write_status()
                        raise
                    self.display.event("warning", f"warning: {exc.code.value}: {exc.detail}", code=exc.code.value)
                    if exc.code is RejectCode.RATE_LIMITED:  # back off like an empty grant, never hammer
                        self.stop.wait(self.idle.after_empty(0.0))
                    else:
                        time.sleep(self.cfg.poll_s)
                except OutboxFull as exc:
                    self.display.event("warning", str(exc))
                    self.stop.wait(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
                except TransportError as exc:
                    self.stop.wait(self._reconnect_wait(self._lease_retry, exc))
                self._write_status()
                self.display.status(self.status, version=self.sync.current.version if self.sync.current else None,
                                    latest=self.latest_version, outbox=len(self.outbox))
        finally:  # leases fetched ahead go back; every finished work is spooled before the last flush
            self._return_ahead(ahead, "stopping")
            if ahead is not None:
                ahead.close()
            if stage is not None:
                stage.close()
            if self._uploader is not None:
                self._uploader.close()
                self._uploader = None
        try:
            self.flush()
        except TransportError as exc:
            self.display.event("warning", f"{len(self.outbox)} batches stay in the outbox ({exc}); "
                               "they are sent on the next join")
        self._write_status()
        self.display.close()
        return self.status

    def _worth_asking_ahead(self, in_flight: int) -> bool:
        """Not before the first lease is measured (the sizer's probe: what this machine can return in time is
        not known yet), nor when --max-batches is reached with the work in hand."""
        if not self.sizer.fixed and not self.sizer.seconds_per_prompt:
            return False
        return not (self.cfg.max_batches and self.status.batches_acked + in_flight + 1 >= self.cfg.max_batches)

    def _in_flight(self, stage) -> int:
        """Works generated and not yet acked or refused (max_batches counts them): pipelined only."""
        return 0 if stage is None else stage.pending + len(self.outbox)

    def _kick_uploads(self) -> None:
        if self._uploader is not None:
            self._uploader.kick()
        else:
            self.flush()

    def _upload_failed(self, exc: Exception | None) -> float:
        """The uploader's back-off: a flush the coordinator deferred (None) or one that could not reach it."""
        from asyncrl.swarm.transport import TransportError

        if isinstance(exc, TransportError):
            return self._reconnect_wait(self._upload_retry, exc)
        if exc is not None:
            self.display.event("warning", f"upload failed: {exc.__class__.__name__}: {str(exc)[:300]}")
        return self._upload_retry.after_failure(exc)

    def _reconnect_wait(self, retry, exc: Exception) -> float:
        """How long to wait after `exc` (a TransportError) by its class (client/pacing.py ReconnectBackoff),
        said on the display."""
        wait = retry.after_failure(exc)
        what = ("coordinator starting (it answers but serves no such stream yet)" if retry.last_class == "starting"
                else "coordinator unreachable")
        self.display.event("warning", f"{what} ({exc}); retrying in {wait:.1f}s", reconnect=retry.last_class)
        return wait

    def _return_ahead(self, ahead, reason: str) -> None:
        """Leases fetched ahead and not started go back to the coordinator now (a pause, a stop)."""
        if ahead is None or not ahead.asked:
            return
        try:
            work = ahead.take()
        except Exception:  # noqa: BLE001 - a failed ask holds no leases
            return
        if work.leases:
            work.keeper.finish()
            self._release(work.leases, reason)

    def _load(self, adapter) -> None:
        if getattr(self, "hold", None) is not None:  # experiment-only --hold-version K
            adapter = self.hold.select(adapter)
            if adapter is None:
                return
        t0 = time.perf_counter()
        self._load_into_engine(adapter)
        verdict = self._canary(adapter)
        if verdict is not None and not verdict.passed:  # once more: a load can fail transiently
            self._load_into_engine(adapter)
            verdict = self._canary(adapter)
        if verdict is not None:
            self._report_canary(adapter.version, verdict, time.perf_counter() - t0)
            if not verdict.passed:  # never spend GPU time on a version the engine did not really load
                self.canary_refused = adapter.version
                return
        self.canary_refused = None
        self.serving_version = adapter.version  # what batches are tagged with (== the newest unless --hold-version)
        self.status.versions_loaded.append(adapter.version)
        if not self.cfg.quiet:
            self.out(f"[{self.name}] adapter v{adapter.version} loaded ({adapter.manifest.codec}, "
                     f"{adapter.manifest.compressed_bytes} bytes)")

    def _load_into_engine(self, adapter) -> None:
        try:
            self.engine.load_adapter(adapter.version, adapter.manifest.tensors, adapter.tensors)
        except (ValueError, RuntimeError) as exc:  # shapes/names that do not fit this base model
            raise BaseModelMismatch(
                "ADAPTER_MISMATCH", f"the coordinator's adapter is for base model {adapter.manifest.base_model!r} "
                f"(revision {adapter.manifest.base_revision}); it does not fit {getattr(self, 'model_name', '?')!r}: "
                f"{str(exc)[:200]}") from None

    def _canary(self, adapter):
        """The engine's verdict on the version's canary (models/canary.py); None when the manifest has none
        or the engine cannot score a given completion."""
        canary, score = adapter.manifest.canary, getattr(self.engine, "score", None)
        if canary is None or score is None:
            return None
        from asyncrl.models.canary import canary_tokens, judge

        prompt, completion = canary_tokens(canary)
        try:
            scored = score(prompt, completion)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot score is not proof of a missing adapter
            self.display.event("warning", f"[{self.name}] adapter v{adapter.version}: the canary could not be "
                               f"scored ({exc.__class__.__name__}: {str(exc)[:200]}); going on without it")
            return None
        return judge(scored, canary, dtype=engine_dtype(self.engine))

    def _report_canary(self, version: int, verdict, seconds: float) -> None:
        """Tell the user (one line on failure) and the coordinator (a health report: with the next lease
        request, or at once when we refuse the version and will ask for no work)."""
        report = messages.CanaryReport(version=version, passed=verdict.passed, diff=round(verdict.diff, 6),
                                       base_diff=round(verdict.base_diff, 6))
        self.status.canary = {"version": version, "passed": verdict.passed, "diff": round(verdict.diff, 6),
                              "base_diff": round(verdict.base_diff, 6), "seconds": round(seconds, 4)}
        if verdict.passed:
            self._canary_report = report
            return
        self.status.canary_failures += 1
        self.display.event("warning", f"[{self.name}] {verdict.explain(version)}", code="CANARY_FAILED")
        try:
            self._rpc().call(adapter_version=getattr(self, "serving_version", 0), canary=report)
        except Exception as exc:  # noqa: BLE001 - said again with the next request
            self._canary_report = report
            self.display.event("warning", f"could not report the failed canary yet ({exc})")

    def _rpc(self):
        from .lease_rpc import LeaseRpc

        return LeaseRpc(self.node, self.identity, coordinator_peer_id=self.coordinator_peer_id,
                        coordinator_key=self.coordinator_key, run_id=self.run_id, client_name=self.name)

    def _lease(self) -> tuple[list[messages.TaskLease], float]:
        report, self._canary_report = self._canary_report, None
        grant = self._rpc().call(adapter_version=self.serving_version, max_prompts=self.sizer.want(),
                                 seconds_per_prompt=self.sizer.reported_rate(),  # client/lease_sizing.py
                                 canary=report)
        self.granted_at = time.monotonic()
        self.latest_version = grant.current_version
        self.sizer.observe_grant(grant)
        if grant.leases:
            self.status.lease_sizes = (self.status.lease_sizes + [len(grant.leases)])[-MAX_SIZES_KEPT:]
        self.max_batch_bytes = grant.max_batch_bytes or self.max_batch_bytes
        return list(grant.leases), grant.retry_after_s

    def _fetch_work(self) -> "Work":
        """One lease request; granted leases are renewed from now on (also while they wait for the engine)."""
        from .lease_keeper import LeaseKeeper

        leases, retry_after = self._lease()
        keeper = LeaseKeeper(self._renew, leases).__enter__() if leases else None
        return Work(leases, keeper, self.granted_at, retry_after)

    def _renew(self, lease_ids: list[str]) -> dict[str, float]:
        """One renewal-only lease request (client/lease_keeper.py): seconds left per lease id."""
        grant = self._rpc().call(adapter_version=self.serving_version, renew=tuple(lease_ids))
        return {r.lease_id: r.expires_in_s for r in grant.renewed}

    def _goodbye(self) -> None:
        """Tell the coordinator we know the run is over (an empty request it answers RUN_FINISHED), so it
        need not linger for us (coordinator/run_end.py)."""
        try:
            self._rpc().call(adapter_version=self.serving_version, timeout=5)
        except Exception:  # noqa: BLE001 - RUN_FINISHED (expected), or it is gone already: we stop either way
            pass

    def _abandon(self, lease: messages.TaskLease, why: str, *, counter: str) -> None:
        """Give up one lease and go on with the rest: its group is not sent, the lease is not renewed (it
        expires and the prompt goes to someone else)."""
        self._count(counter)
        self._count("leases_abandoned")
        self.display.event("warning", f"[{self.name}] lease {lease.lease_id} (prompt {lease.prompt_id}) "
                           f"abandoned: {why}", code=counter)

    def _generate(self, leases: list[messages.TaskLease], group_size: int, sampling) -> list[tuple]:
        """(lease, samples) for every lease the engine could serve. A lease whose prompt plus max_new_tokens
        does not fit this engine's context is not tried (a shorter completion would be refused); an engine
        error is retried lease by lease, so one bad prompt costs its own lease, never the others or the
        volunteer. Only an engine that fails every lease of ENGINE_FAILURE_STREAK works in a row stops us."""
        limit = getattr(self.engine, "context_limit", None)
        todo = []
        for lease in leases:
            n = len(lease.prompt_token_ids) // 4
            if limit is not None and n + sampling.max_new_tokens > limit:
                self._abandon(lease, f"prompt of {n} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                              f"this engine's context of {limit} tokens", counter="leases_too_long")
            else:
                todo.append(lease)
        episodes = [(l, self._episodes(l, group_size, sampling)) for l in todo if is_episode_lease(l)]
        episodes = [(l, samples) for l, samples in episodes if samples is not None]
        todo = [l for l in todo if not is_episode_lease(l)]
        if not todo:
            return episodes
        prompts = [np.frombuffer(l.prompt_token_ids, dtype="<i4").tolist() for l in todo]
        try:
            done = list(zip(todo, self.engine.generate(prompts, group_size, sampling)))
            self._engine_failures = 0
            return episodes + done
        except Exception as exc:  # noqa: BLE001 - any engine error: find the lease it belongs to
            first = exc
        done = []
        if len(todo) == 1:
            self._abandon(todo[0], f"engine error: {first.__class__.__name__}: {str(first)[:300]}",
                          counter="engine_errors")
        else:
            for lease, prompt in zip(todo, prompts):
                try:
                    done.append((lease, self.engine.generate([prompt], group_size, sampling)[0]))
                except Exception as exc:  # noqa: BLE001
                    self._abandon(lease, f"engine error: {exc.__class__.__name__}: {str(exc)[:300]}",
                                  counter="engine_errors")
        self._engine_failures = 0 if done else getattr(self, "_engine_failures", 0) + 1
        if self._engine_failures >= ENGINE_FAILURE_STREAK:
            raise EngineFailed(f"the engine failed every lease of {self._engine_failures} works in a row; last "
                               f"error: {first.__class__.__name__}: {str(first)[:300]}") from first
        return episodes + done

    def _episodes(self, lease, group_size: int, sampling) -> list | None:
        """A multi-turn lease played turn by turn (client/episodes.py); an environment that fails here costs
        this lease only (None)."""
        from asyncrl.envs import EnvError

        try:
            return generate_episodes(self.engine, lease, group_size, sampling)
        except EnvError as exc:
            self._abandon(lease, f"environment failed: {str(exc)[:300]}", counter="env_errors")
            return None

    def _generate_politely(self, leases, group_size: int, sampling) -> tuple[list[tuple], list, str | None]:
        """(generated, unfinished, pause reason). With --only-when-idle one prompt at a time, asking
        IdleWatch between them: when the machine is wanted, the leases not yet started are left for the
        caller to return. Otherwise all prompts in one engine call (vLLM batches them)."""
        if not self.cfg.only_when_idle:
            return self._generate(leases, group_size, sampling), [], None
        generated = []
        for i, lease in enumerate(leases):
            if i:
                reason = self.polite.busy()
                if reason is not None:
                    return generated, list(leases[i:]), reason
            self.status.state, self.status.lease_progress = "generating", [i, len(leases)]
            self._write_status()
            generated += self._generate([lease], group_size, sampling)
        return generated, [], None

    def _release(self, leases: list[messages.TaskLease], reason: str | None, *, unscorable: bool = False,
                 reward_error: str = "") -> None:
        """Give leases back (a LeaseRequest with `release`): their prompts go to someone else now, instead
        of waiting out the lease timeout (coordinator/leasing/taskboard.py `release`). With `unscorable` they are
        leases whose groups our reward check could not score (`LeaseRequest.unscorable`): the coordinator
        counts them against the prompt and retires a prompt nobody can score. A lost answer is asked once
        more after RELEASE_RETRY_S, like a renewal (returning is idempotent: ids no longer held are ignored)."""
        from asyncrl.swarm.transport import TransportError

        ids = tuple(l.lease_id for l in leases)
        for attempt in range(2):
            try:
                self._rpc().call(adapter_version=self.serving_version, reward_error=reward_error,
                                 **({"unscorable": ids} if unscorable else {"release": ids}))
            except TransportError as exc:
                if attempt == 0:
                    self.stop.wait(RELEASE_RETRY_S)
                    continue
                self.display.event("warning", f"could not return {len(ids)} leases ({exc}); they will expire")
                return
            except ProtocolError as exc:  # they expire on their own, as without polite mode
                self.display.event("warning", f"could not return {len(ids)} leases ({exc}); they will expire")
                return
            if unscorable:
                self.display.event("info", f"[{self.name}] reported {len(ids)} leases we could not score ({reason})")
                return
            self._count("leases_returned", len(ids))
            self.display.event("info", f"[{self.name}] returned {len(ids)} unfinished leases ({reason})")
            return

    def _pause(self, reason: str) -> None:
        """Polite mode / `asyncrl-client pause`: no work until the machine is free again (client/polite.py)."""
        self.status.state, self.status.pause_reason = "paused", reason
        self._write_status()
        self.display.event("info", f"[{self.name}] paused: {reason}")
        t0 = time.monotonic()
        while not self.stop.is_set() and self.polite.busy() is not None:
            self.stop.wait(PAUSE_POLL_S)
        self.status.paused_s += time.monotonic() - t0
        self.status.state, self.status.pause_reason = "working", ""
        self.display.event("info", f"[{self.name}] resumed after {time.monotonic() - t0:.0f} s")

    def _generate_work(self, work: "Work") -> float:
        """Engine thread: generate every leased prompt in one engine call; returns the seconds it took."""
        work.version = self.serving_version  # what the batch is tagged with: the adapter it was generated with
        t0 = time.perf_counter()
        self.status.state = "generating"
        work.generated, work.unfinished, work.reason = self._generate_politely(
            work.leases, work.leases[0].group_size, work.leases[0].sampling)
        busy = time.perf_counter() - t0
        self.status.engine_busy_s += busy
        self.status.state = "working"
        if work.unfinished:  # paused mid-lease: the rest goes back to the coordinator now, before we rest
            self._release(work.unfinished, work.reason)
        return busy

    def _finish_work(self, work: "Work") -> int:
        """Scorer (off the engine thread): score each group, leave out lost leases, spool the batch, wake the
        uploader; returns the number of groups spooled. The keeper renews the leases until the batch is
        built: a reward check can take its whole time limit per group (a stuck math check: 10 s)."""
        from asyncrl import tasks

        from .outbox import OutboxFull

        results = []
        try:
            for lease, group in work.generated:
                texts = [self.engine.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group]
                prompt = tasks.Prompt(lease.prompt_id, lease.prompt, lease.answer, lease.reward, lease.columns)
                if is_episode_lease(lease):  # the environment scored its episodes as they were played
                    results.append((lease, group, [s.reward for s in group]))
                    continue
                try:  # the coordinator re-scores with this same call (coordinator/ingest/ingest.py)
                    results.append((lease, group, tasks.score_group(prompt, texts, [s.token_ids for s in group],
                                                                   version=work.version).rewards))
                except Exception as exc:  # noqa: BLE001 - a broken reward costs its group, not the volunteer
                    results.append((lease, group, exc))
        finally:
            work.keeper.finish()
        keeper = work.keeper
        self._count("lease_renewals", keeper.renewals)
        groups, unscored, raised, lost = [], [], [], 0
        for lease, group, scored in results:
            if lease.lease_id in keeper.lost:
                self._abandon(lease, "the coordinator no longer holds it for us (expired)", counter="leases_lost")
                lost += 1
                continue
            if isinstance(scored, Exception):
                exc = scored
                why = f"reward {lease.reward!r} failed: {exc.__class__.__name__}: {str(exc)[:300]}"
                if isinstance(exc, tasks.Unscorable):  # our verifier could not finish: send nothing rather than a guess
                    self._count("groups_unscorable")
                    unscored.append(lease)
                else:  # the reward function itself raised: the operator must see it (coordinator's log, dashboard)
                    raised.append((lease, why))
                self._abandon(lease, why, counter="reward_errors")
                continue
            comps = []
            for s, reward in zip(group, scored):
                comps.append(episode_completion(s) if is_episode_lease(lease) else messages.Completion(
                    token_ids=np.asarray(s.token_ids, dtype="<i4").tobytes(),
                    logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(), reward=reward,
                    finish_reason=s.finish_reason))
                self.status.rollouts += 1
                self.status.tokens += len(s.token_ids)
                self.status.reward_sum += reward
            groups.append(messages.RolloutGroup(lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                                                prompt_token_ids=lease.prompt_token_ids, completions=tuple(comps)))
        if unscored:  # said at once: the prompt goes to someone else now, and a poison prompt gets retired
            self._release(unscored, "reward check did not finish", unscorable=True)
        if raised:
            self._release([l for l, _ in raised], "reward raised",
                          reward_error=raised[0][1][:limits.MAX_REWARD_ERROR_CHARS])
        tried = len(work.leases) - len(work.unfinished)  # a pause returns the rest
        if not groups:
            if lost:  # grant to losing it: the sizer learns this machine is too slow for what it asked
                self._measured(tried, work.granted_at)
            return 0
        batch = messages.RolloutBatch(run_id=self.run_id, adapter_version=work.version, client_name=self.name,
                                      sampling=work.leases[0].sampling, groups=tuple(groups), generated_at=time.time(),
                                      engine_dtype=engine_dtype(self.engine), engine_kind=engine_kind(self.engine))
        try:
            spooled = self._spool(batch)
        except OutboxFull as exc:  # the disk cap: these leases expire; the engine thread pauses near the cap
            self.display.event("warning", str(exc))
            return 0
        pending = PendingAck(tried, work.granted_at)
        for batch_id in spooled:
            self._awaiting_ack[batch_id] = pending
        self._write_status()
        self._kick_uploads()
        return len(groups)

    def _measured(self, prompts: int, granted_at: float) -> None:
        """Grant to ack (or to losing the leases), per prompt: the sizer's measurement (client/lease_sizing.py)."""
        self.sizer.measured(prompts, time.monotonic() - granted_at)
        self.status.seconds_per_prompt = round(self.sizer.seconds_per_prompt, 3)

    def _count(self, counter: str, n: int = 1) -> None:
        """Status counters bumped from more than one thread (engine, scorer, uploader)."""
        with self._counter_lock:
            setattr(self.status, counter, getattr(self.status, counter) + n)

    def _count_code(self, field_name: str, code: str) -> None:
        with self._counter_lock:  # _write_status copies these dicts under the same lock
            counts = getattr(self.status, field_name)
            counts[code] = counts.get(code, 0) + 1

    def _spool(self, batch: messages.RolloutBatch) -> list[bytes]:
        """Write `batch` to the outbox (split by groups if it would exceed the coordinator's cap)."""
        payload = messages.encode(batch)
        cap = self.max_batch_bytes
        if cap and len(payload) + SEAL_OVERHEAD > cap and len(batch.groups) > 1:
            import msgspec

            half = len(batch.groups) // 2
            self.status.batches_split += 1
            return (self._spool(msgspec.structs.replace(batch, groups=batch.groups[:half]))
                    + self._spool(msgspec.structs.replace(batch, groups=batch.groups[half:])))
        batch_id = self.outbox.put(payload)
        self.display.event("spooled", f"[{self.name}] batch {batch_id.hex()[:12]} spooled", batch_id=batch_id.hex(),
                           groups=len(batch.groups))
        return [batch_id]

    def flush(self) -> bool:
        """Upload every spooled batch, oldest first, each sealed afresh; stop early when the coordinator
        says "later" (busy, clock) and raise TransportError when it cannot be reached. True when it got
        through the outbox. One flush at a time (the uploader thread, or the engine thread at start and end)."""
        with self._flush_lock:
            sent = self.status.batches_sent
            try:
                for batch_id in self.outbox.pending():
                    payload = self.outbox.read(batch_id)
                    if payload is None:
                        continue
                    if not self._upload(batch_id, payload):
                        return False
                self._upload_retry.reset()
                return True
            finally:
                if self.status.batches_sent != sent and self._uploader is not None:
                    self._write_status()  # the engine thread writes it too, but may be waiting for work

    def _upload(self, batch_id: bytes, payload: bytes) -> bool:
        """One upload attempt; False = stop this flush (retry later)."""
        sealed = envelope.seal(self.identity, "rollout_batch", payload, audience=self.coordinator_key)
        try:
            raw = self.node.call(self.coordinator_peer_id, stream_name(self.run_id, streams.SUBMIT), sealed,
                                 max_response_bytes=64 * 1024)
            ack = messages.decode(raw, messages.Ack, max_bytes=64 * 1024)
            code, detail, receipt = (None if ack.accepted and ack.code is None else ack.code or "?"), ack.detail, \
                ack.receipt
            if ack.accepted and ack.code == RejectCode.DUPLICATE_BATCH.value:
                code = None  # the coordinator already has it (a lost ack's retry)
        except ProtocolError as exc:  # refused by the transport before ingest: too large, busy, banned peer
            code, detail, receipt = exc.code.value, exc.detail, b""
        self.status.batches_sent += 1
        return self._settle(batch_id, payload, code, detail, receipt)

    def _settle(self, batch_id: bytes, payload: bytes, code: str | None, detail: str, receipt: bytes = b"") -> bool:
        short = batch_id.hex()[:12]
        self._settled.set()
        if code is None:
            self.status.batches_acked += 1
            self._keep_receipt(batch_id, receipt)  # on disk before the batch leaves the outbox
            self.outbox.remove(batch_id)
            pending = self._awaiting_ack.pop(batch_id, None)
            if pending is not None and not pending.measured:  # the first part of a (split) batch to be acked
                pending.measured = True
                self._measured(pending.prompts, pending.granted_at)
            self._internal_failures.pop(batch_id, None)
            self.display.event("acked", f"[{self.name}] batch {short} acked", batch_id=batch_id.hex())
            return True
        if code in RETRY_LATER:
            self._count_code("batches_deferred", code)
            hint = " (is this machine's clock right?)" if code == RejectCode.EXPIRED.value else ""
            self.display.event("deferred", f"[{self.name}] batch {short} kept for later: {code} {detail}{hint}",
                               code=code, batch_id=batch_id.hex())
            return False
        if code in RETRY_BATCH:
            self._count_code("batches_deferred", code)
            failures = self._internal_failures[batch_id] = self._internal_failures.get(batch_id, 0) + 1
            if failures < MAX_INTERNAL_RETRIES:
                self.outbox.requeue(batch_id)  # the others go first
                return True
            code = f"{code}x{failures}"
        elif code in SPLIT:
            if self._split_spooled(batch_id, payload):
                return True
        if code == RejectCode.RUN_FINISHED.value:
            self.status.run_finished = True  # what is still spooled can no longer be trained: dropped, counted
        if code in FINAL_REJECTS:
            self._count_code("batches_rejected", code)
            self.outbox.remove(batch_id)
            self.display.event("rejected", f"[{self.name}] batch {short} rejected: {code} {detail}", code=code,
                               batch_id=batch_id.hex())
            return True
        where = self.outbox.quarantine(batch_id, code, detail)
        self._internal_failures.pop(batch_id, None)
        self.status.batches_quarantined += 1
        self.display.event("warning", f"[{self.name}] batch {short} quarantined in {where.parent} ({code} {detail}); "
                           "the coordinator cannot take it as it is", code=code, batch_id=batch_id.hex())
        return code != RejectCode.NOT_ALLOWED.value  # not admitted: the next batch would fare no better

    def _split_spooled(self, batch_id: bytes, payload: bytes) -> bool:
        """A spooled batch over the coordinator's cap: re-spool its groups as smaller batches (written
        before the original is removed, so a crash in between leaves duplicates, never a loss — the
        coordinator dedupes nothing here: it never accepted the big one). False when it is one group."""
        try:
            batch = messages.decode(payload, messages.RolloutBatch, max_bytes=len(payload))
        except ProtocolError:
            return False
        if len(batch.groups) < 2:
            return False
        import msgspec

        half = len(batch.groups) // 2
        self.max_batch_bytes = min(self.max_batch_bytes or len(payload), len(payload))  # what we now know
        for part in (batch.groups[:half], batch.groups[half:]):
            self._spool(msgspec.structs.replace(batch, groups=part))
        self.outbox.remove(batch_id)
        self.status.batches_split += 1
        self.display.event("warning", f"[{self.name}] batch {batch_id.hex()[:12]} too large for the coordinator; "
                           "split in two", code=RejectCode.PAYLOAD_TOO_LARGE.value)
        return True

    def _keep_receipt(self, batch_id: bytes, sealed: bytes) -> None:
        from asyncrl.protocol import receipts

        if not sealed:
            self.status.receipts_missing += 1
            return
        try:
            receipt = receipts.open_receipt(sealed, coordinator_key=self.coordinator_key,
                                            volunteer_key=self.identity.public_key)
            if receipt.batch_id != batch_id or receipt.run_id != self.run_id:
                raise ProtocolError(RejectCode.MALFORMED, "receipt for another batch")
        except ProtocolError as exc:
            self.status.receipts_invalid += 1
            self.display.event("warning", f"receipt for batch {batch_id.hex()[:12]} not kept: {exc}",
                               code=exc.code.value)
            return
        if self.ledger.append(sealed):
            self.status.receipts += 1

    def _write_status(self) -> None:
        from asyncrl.protocol.atomic import write_json_atomic

        swarm = self.swarm.stats() if getattr(self, "swarm", None) is not None else None
        with self._status_lock:  # written by the engine, scorer and uploader threads: one snapshot at a time
            with self._counter_lock:
                status = asdict(self.status)
            write_json_atomic(self.cfg.data_dir / "status.json",
                              {**status, "outbox": len(self.outbox), "outbox_pending": [
                                  b.hex() for b in self.outbox.pending()[:256]],
                               "run_id": self.run_id, "swarm": swarm, "coordinator_peer_id": self.coordinator_peer_id})

    def shutdown(self) -> None:
        if getattr(self, "swarm", None) is not None:
            self.swarm.stop()
        node = getattr(self, "node", None)
        if node is not None:
            node.shutdown()
