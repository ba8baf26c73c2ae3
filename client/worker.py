"""Volunteer hub: join, follow the adapter, generate, score, sign, spool, upload.

`Volunteer` is this hub: it holds the config, the status and the components, and runs the engine thread's
loop. Its behaviour lives in four parts, each a module of its own that `Volunteer` inherits (they share the
hub's state; none imports this hub):

  Session      (client/session.py)   join checks, the P2P node, the first adapter, the pinned engine, adapter
                                     hot-swaps checked by their canary
  LeaseCalls   (client/lease_rpc.py) the one lease RPC client: ask for work, renew, return, goodbye
  Rollout      (client/rollout.py)   generate, score, build the RolloutBatch, abandon what one lease breaks
  Delivery     (client/delivery.py)  spool, upload sealed afresh, what each answer does to a spooled batch

Components (one job each; none references this hub):
  SwarmNode    (asyncrl.swarm.transport)  hivemind DHT + P2P streams to the coordinator
  AdapterSync  (client/adapter_sync.py) watch the signed pointer, fetch + verify + decode adapter versions
  Engine       (client/engine_api.py) generation with per-token sampling logprobs (client/engine.py: transformers
               and make_engine; client/engine_vllm.py: vLLM)
  Outbox       (client/outbox.py) batch payloads on disk until acked; sealed afresh at each upload
  ReceiptLedger (client/ledger.py) each ack's coordinator-signed receipt, verified, append-only
  LeaseKeeper  (client/lease_keeper.py) renews the leases being worked on
  LeaseSizer   (client/lease_sizing.py) prompts per lease from this machine's measured rate
  IdleWatch    (client/polite.py) --only-when-idle / `asyncrl-client pause`: pause, returning unfinished leases
  pipeline     (client/pipeline.py) LeaseAhead / Stage / Uploader: the threads that keep the engine busy
  status.json  what this volunteer did (for `asyncrl-client status` and tests)

Loop (the engine thread): poll the pointer (hot-swap a newer adapter between batches) -> take the leases
fetched ahead (and ask for the next ones) -> generate G completions each, all prompts in one engine call
-> hand the work to the scorer thread (score -> spool the RolloutBatch payload), whose spool wakes the
uploader thread (seal with a fresh timestamp + nonce -> upload -> delete on ack). `--no-pipeline` runs the
same steps in series on one thread (benchmarks compare the two). What each upload answer does to a spooled
batch: client/delivery.py and docs/client.md.

Fault injection for tests subclasses `Volunteer` and overrides one of these parts' methods
(tests/fault_volunteer.py); the shipping volunteer carries no test hooks.

    asyncrl-client join /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from asyncrl.protocol.atomic import write_json_atomic
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity
from asyncrl.swarm.bootstrap import join_spec
from asyncrl.swarm.transport import TransportError, parse_join_address

from .delivery import Delivery, PendingAck
from .display import Display
from .lease_rpc import FINAL_LEASE_REJECTS, LeaseCalls
from .lease_sizing import LeaseSizer
from .ledger import ReceiptLedger
from .outbox import Outbox, OutboxFull
from .pacing import MAX_BACKOFF_S, ReconnectBackoff
from .pipeline import LeaseAhead, Stage, Uploader
from .polite import IdleWatch
from .rollout import Rollout
from .session import Session

PAUSE_POLL_S = 2.0  # paused: how often to look whether the machine is free again


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


class Volunteer(Session, LeaseCalls, Rollout, Delivery):
    def __init__(self, cfg: VolunteerConfig, *, out=None):
        self.cfg = cfg
        self.display = Display(cfg.display)
        self.out = out or (lambda message: self.display.event("info", message))
        self.stop = threading.Event()
        self.addr = parse_join_address(cfg.address)  # BadAddress before anything starts
        self.join = join_spec([cfg.address, *cfg.more_addresses], cfg.coordinator)  # whose key we trust
        self.coordinator_peer_id = self.join.coordinator_peer_id
        self.coordinator_key = self.join.coordinator_key
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity, created = Identity.load_or_create(cfg.data_dir / "identity.key")
        if created:
            self.out(f"created volunteer identity {self.identity.fingerprint} in {cfg.data_dir / 'identity.key'}")
        self.name = cfg.name or f"volunteer-{self.identity.fingerprint[:9].replace(':', '')}"
        self.outbox = Outbox(cfg.data_dir / "outbox", max_bytes=cfg.max_outbox_bytes)
        self.ledger = ReceiptLedger(cfg.data_dir)
        self.status = VolunteerStatus(name=self.name, fingerprint=self.identity.fingerprint)
        self.run_id: str | None = None
        self.latest_version: int | None = None
        self.sizer = LeaseSizer(cfg.prompts_per_batch, fixed=cfg.fixed_lease_size)  # work sized to this machine
        self.granted_at = 0.0
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
        self._upload_retry = ReconnectBackoff()  # the uploader's waits after a failed flush (client/delivery.py)
        self._lease_retry = ReconnectBackoff()  # the lease loop's, after a call that reached no coordinator
        self.canary_refused: int | None = None  # a version whose canary failed: no work until a newer one passes
        self._canary_report = None  # a passed canary, said with the next lease request
        if self.outbox.migrated:
            self.out(f"converted {self.outbox.migrated} spooled batches from an older client to payloads")

    # ---- main loop (the engine thread; client/pipeline.py) --------------------------------------
    def run(self) -> VolunteerStatus:
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

    def _count(self, counter: str, n: int = 1) -> None:
        """Status counters bumped from more than one thread (engine, scorer, uploader)."""
        with self._counter_lock:
            setattr(self.status, counter, getattr(self.status, counter) + n)

    def _count_code(self, field_name: str, code: str) -> None:
        with self._counter_lock:  # _write_status copies these dicts under the same lock
            counts = getattr(self.status, field_name)
            counts[code] = counts.get(code, 0) + 1

    def _write_status(self) -> None:
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
