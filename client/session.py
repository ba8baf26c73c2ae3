"""Session: from the join address to an engine serving the coordinator's adapter (a mixin of the hub's `Volunteer`).

Owns everything before the first lease and the adapter it generates with:

  connect           the P2P node (client/swarm_member.py), the handshake, AdapterSync, the pacing helpers
  _handshake        join's cheap checks (client/checks.py): the version gate, the run state, the clock;
                    --follow waits for the coordinator's next run (`_wait_for_next_run`)
  wait_for_adapter  the first adapter version, waited for until stopped
  load_engine       the exact base model the manifest pins (models/pinning.py), verified, then the engine
  _load             a verified adapter version hot-swapped into the engine between works, checked by its
                    canary (models/canary.py); a version whose canary fails is refused (`canary_refused`)
                    and said to the coordinator; --hold-version picks an older one (client/version_hold.py)

It sets the hub's `node`, `handshake`, `run_id`, `sync`, `swarm`, `pacer`, `idle`, `hold`, `engine`,
`model_name`, `serving_version`, `canary_refused`, and reads its `cfg`, `join`, `identity`, `status`,
`display`, `stop`, `sizer`.
"""

from __future__ import annotations

import time

from asyncrl.models.canary import canary_tokens, judge
from asyncrl.models.pinning import PinError, pin_of
from asyncrl.models.sources import locate
from asyncrl.protocol import messages
from asyncrl.protocol.errors import RejectCode
from asyncrl.swarm import bootstrap
from asyncrl.swarm.transport import check_reachable, parse_join_address

from .adapter_sync import AdapterSync
from .checks import FAIL, WARN, cheap_join_checks, exchange, missing_reward_packages
from .pacing import DutyCycle, IdleBackoff
from .rollout import engine_dtype
from .swarm_member import SwarmMembership, open_node
from .version_hold import HeldAdapters

FOLLOW_FIRST_WAIT_S, FOLLOW_MAX_WAIT_S = 5.0, 120.0  # --follow: how often to ask for the next run


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


class Session:
    def connect(self, run_id: str | None = None, timeout: float = 60.0) -> None:
        check_reachable([parse_join_address(a) for a in self.join.bootstrap])
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
        self.pacer = DutyCycle(self.cfg.duty_cycle)
        self.idle = IdleBackoff(self.cfg.poll_s)
        self.hold = HeldAdapters(self.sync, self.cfg.hold_version) if self.cfg.hold_version else None

    def _handshake(self):
        """`asyncrl.info` (client/checks.py): refuse to start when the gate, the run state or the clock say no."""
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
        try:
            exchange(self.node, self.coordinator_peer_id,
                     missing_rewards=tuple(p.reward for p in missing_reward_packages(hs.info)))
        except Exception as exc:  # noqa: BLE001 - the refusal stands whether or not the report arrived
            self.display.event("warning", f"could not tell the coordinator about the missing packages: {exc}")

    def _wait_for_next_run(self, hs):
        """--follow: ask the coordinator again, less and less often, until it runs an unfinished run."""
        wait = FOLLOW_FIRST_WAIT_S
        self.display.event("info", f"run {hs.info.run_id!r} has finished; waiting for the next one (--follow)")
        while not self.stop.wait(wait):
            wait = min(FOLLOW_MAX_WAIT_S, wait * 2)
            try:
                bootstrap.rejoin(self.node, self.join.bootstrap)  # it may have restarted
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
        from .engine import make_engine  # imports torch: only a volunteer that starts an engine pays for it

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

