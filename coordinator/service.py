"""Coordinator hub: wires the components and runs the learner loop.

Components (each has one job; none references this hub):
  SwarmNode   (asyncrl.swarm.transport)  hivemind DHT + P2P streams; serves the handlers below
  Publisher   adapter -> codec -> signed manifest + chunks; signed pointer stored in the DHT, all on the
              publisher thread (PublishWorker, newest wins): the learner only exports and hands over
  TaskBoard   prompt leases, expiry and re-leasing
  LeaseDesk   (coordinator/leasing/leasing.py) who gets which prompts, with back-pressure on in-flight work
  Ingest      verify + decode + re-score signed rollout batches; bounded queue to the learner
  Learner     GRPO steps on the LoRA adapter; owns the version counter
  RunLog      (asyncrl/runlog.py) metrics.jsonl in the run directory; summary.json at the end
  Journal     (coordinator/ingest/journal.py) accepted batches on disk before their ack
  ReceiptDesk (coordinator/ingest/receipts.py) a signed contribution receipt in every ack; receipts.bin
  RunEnd      (coordinator/run_end.py) max_steps or `finish`: RUN_FINISHED, the final pointer, a short linger
  Checkpointing (coordinator/checkpoint.py) atomic checkpoints every N steps and at exit; --resume
  Telemetry   (coordinator/operator/telemetry.py) RunLog listener: stats, dashboard + /metrics, plots, trackers
  AccessControl (coordinator/trust/access.py) open/allowlist, bans, rate limits, quotas, strikes
  Auditor     (coordinator/trust/audit.py) logprob audit under the claimed adapter version (learner hook)
  AuditWorker (coordinator/trust/audit_worker.py) shadow-model audits after the ack, bounded queue, own thread/stream
  TrustState  (coordinator/trust/trust_state.py) trust.json, replay.bin, access.bin every few seconds
  VolunteerQuorum (coordinator/leasing/quorum.py) --wait-for-volunteers N: no lease, no step before N keys are in

P2P handlers: the unscoped `asyncrl.info` handshake (coordinator/leasing/handshake.py: versions and the version
gate, clock, run state, newest pointer, NAT dial-back); scoped by run id: `manifest` (version -> sealed manifest),
`chunk` (version, index -> bytes), `lease` (sealed LeaseRequest -> LeaseGrant), `submit`
(sealed RolloutBatch -> Ack). Handlers run on the P2P loop thread and push blocking work
(verification, tokenizer) to a thread pool; the learner runs on the main thread and never waits on
the network (coordinator/publisher.py PublishWorker holds the back-pressure invariant).

    asyncrl-coordinator run --model tiny --max-steps 150

Stages: `Coordinator.build(cfg)` (or `build_components()` on a hub whose signal handlers are in) constructs
every component in order and restores a resumed run's state; `start()` serves them, publishes the first version
and prints the join address; `run()` is the learner loop; `shutdown()` stops what started.

Size: the hub. Every component it wires is its own module; what stays here is the construction order
(which matters: the DHT forks before torch and vLLM load) and the learner loop that ties them together.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from pathlib import Path

import torch

from asyncrl import signals
from asyncrl.protocol import messages
from asyncrl.protocol.atomic import read_json, write_json_atomic
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.handshake import MAX_INFO_REQUEST_BYTES, MAX_REWARD_PACKAGES, RewardPackage
from asyncrl.protocol.handshake import package_versions as handshake_package_versions
from asyncrl.protocol.identity import Identity
from asyncrl.runlog import METRICS_FILE, RunLog
from asyncrl.swarm import streams
from asyncrl.swarm.inbound import InboundLimits
from asyncrl.swarm.providers import ProviderDesk
from asyncrl.swarm.serving import AdapterServer, ServeBudget
from asyncrl.swarm.streams import stream_name
from asyncrl.swarm.transport import SwarmNode, TransportError
from asyncrl.tasks.rewards import packages_of
from asyncrl.tasks.sources import TaskSourceError

from . import checkpoint
from .base_model import resolve_model
from .config import CoordinatorConfig
from .ingest.episodes import environment_pin, replay_metrics
from .ingest.ingest import Ingest, IngestBooks
from .ingest.journal import IngestJournal
from .ingest.receipts import ReceiptDesk
from .learner.ddp import make_learner
from .leasing import preflight
from .leasing.handshake import GatePolicy, HandshakeDesk
from .leasing.leasing import MAX_LEASE_REQUEST_BYTES, LeaseDesk, LeasePolicy
from .leasing.quorum import VolunteerQuorum
from .leasing.sync_round import SyncRound
from .leasing.taskboard import TaskBoard
from .operator.capacity import CapacityMeter
from .operator.reward_log import CompletionLog, RewardErrors, reward_stats
from .operator.telemetry import Telemetry
from .publisher import Publisher, PublishWorker, export_version
from .run_end import RunEnd
from .trust.access import AccessControl, AccessPolicy
from .trust.audit import Auditor
from .trust.trust_state import TrustState

FINAL_POINTER_WAIT_S = 90.0  # at the run's end the publisher thread may still be storing the last version
AUDIT_ENGINES_FILE = "audit_engines.json"  # each engine class's learned audit tolerance (trust/audit_policy.py)



def task_reward_packages(source, cfg) -> tuple:
    """The packages the task's rewards come from (records' own specs and the default), for the handshake."""
    specs = {r.reward for r in getattr(source, "records", ())} | {cfg.reward_spec()}
    found = [RewardPackage(reward=n, package=d, version=v) for n, d, v in packages_of(specs)]
    if len(found) > MAX_REWARD_PACKAGES:
        raise TaskSourceError(f"the task's rewards come from {len(found)} packages; a handshake names at most "
                              f"{MAX_REWARD_PACKAGES}")
    return tuple(found)


class Coordinator:
    """The hub: build, start, run, shutdown (the module docstring's "Stages"). `Coordinator(cfg).start()` builds
    first when `build_components()` has not run."""

    def __init__(self, cfg: CoordinatorConfig, *, out=print):
        self.cfg = cfg.validate()
        self.out = out
        self.stop = threading.Event()
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.write(self.run_dir)
        self.identity, _ = Identity.load_or_create(self.run_dir / "coordinator.key")
        self.identity.write_libp2p_identity(self.run_dir / "p2p.identity")
        self.telemetry = Telemetry(cfg, self.run_dir, out=out)
        self.log = RunLog(self.run_dir / METRICS_FILE, listeners=[self.telemetry.observe])
        self.t0 = time.time()
        self.trained_by: dict[str, int] = {}  # volunteer key fingerprint -> groups trained on (this process)
        # does the swarm keep the learner busy? how many more volunteers would? (coordinator/operator/capacity.py)
        self.capacity = CapacityMeter(samples_per_step=cfg.groups_per_step * cfg.group_size, group_size=cfg.group_size)
        self.reward_errors = RewardErrors()  # what volunteers' reward functions raised (operator/reward_log.py)
        self.handshake_refusals = RewardErrors()  # volunteers turned away at the handshake (same shape of record)
        self.run_end = RunEnd(self.run_dir, active_window_s=cfg.lease_timeout_s)  # max_steps / `finish`: say so
        self.built = False

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: CoordinatorConfig, *, out=print) -> Coordinator:
        """The hub with every component constructed and restored (--resume); nothing served or published yet."""
        hub = cls(cfg, out=out)
        hub.build_components()
        return hub

    def build_components(self) -> None:
        """Every component, in this order (each group needs the ones before it)."""
        self._build_swarm_side()  # first: the DHT forks before torch spins up threads or CUDA
        self._build_learner()  # the pinned base model, the learner, the task and the reward packages it needs
        self._build_intake()  # task board, journal, access control, auditor, receipts, ingest, lease desk
        self._build_publishing()  # publisher, checkpoints (--resume restores here), trust state, publish worker
        self.built = True

    def _build_swarm_side(self) -> None:
        """The node, the pointer and the presence/provider desks. They start at once: a restarted coordinator
        dials back the volunteers it knew while its model loads."""
        cfg = self.cfg
        # With initial_peers it joins an existing DHT (e.g. a stock hivemind-dht node) instead of starting one.
        try:
            self.node = SwarmNode(initial_peers=cfg.initial_peers, host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"],
                                  announce_maddrs=cfg.announce or None,
                                  identity_path=str(self.run_dir / "p2p.identity"), inbound=inbound_limits(cfg))
        except Exception as exc:
            if not cfg.initial_peers:
                raise
            raise TransportError(f"could not join the DHT through --initial-peers {' '.join(cfg.initial_peers)} "
                                 f"({exc.__class__.__name__}: {exc}); is one of them running and reachable?") from None
        assert self.node.peer_id == self.identity.peer_id, "p2pd did not adopt the coordinator key"
        self.node_up = time.monotonic()  # the handlers come up later (start): the "serving" event says how much
        # swarm/records.py imports hivemind (seconds, a thread) at import: loaded with the node, not this module
        from asyncrl.swarm.records import PointerRecord, PresenceTracker, call_back_then_push, install_validator

        install_validator(self.node, cfg.run_id, self.node.peer_id)  # only our key may write our pointer
        # Volunteers' version lag (all presence shards); the addresses the volunteers we vouch for were seen
        # connecting from go to peers.json and are dialled back after a restart (docs/scale.md).
        peers_path = self.run_dir / "peers.json"
        self.presence_tracker = PresenceTracker(self.node, cfg.run_id,
                                                save_peers=lambda known: write_json_atomic(peers_path, {"peers": known}),
                                                load_peers=lambda: _saved_peers(peers_path),
                                                keep=lambda peer: self.providers.vouched(peer) or self._proven_peer(peer))
        # The fetch sources we vouch for (probed; volunteers with accepted batches first), signed.
        self.providers = ProviderDesk(self.node, self.identity, cfg.run_id, self.presence_tracker,
                                      proven=self._proven_peer)
        self.presence_tracker.start()
        self.providers.start()
        self.pointer = PointerRecord(self.node, self.identity, cfg.run_id, providers=self.providers)
        threading.Thread(target=call_back_then_push, args=(self.presence_tracker, self.pointer), name="call-back",
                         daemon=True).start()

    def _build_learner(self) -> None:
        cfg = self.cfg
        self.base = resolve_model(cfg, out=self.out)  # PinError (one line, exit 2) when it cannot be pinned
        path, pin = self.base.path, self.base.pin
        self.base_model, self.base_revision = pin.name, pin.revision
        self.out(f"base model {pin.name} pinned at {pin.revision} (tokenizer {pin.tokenizer_sha256[:19]}, "
                 f"stop tokens {list(pin.stop_token_ids)})")
        self.lora = messages.LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                      target_modules=tuple(cfg.lora_targets))
        # a DDP learner under torchrun (coordinator/learner/ddp.py); device, dtype, micro-batches from the config
        self.learner = make_learner(path, self.lora, **cfg.learner_kwargs())
        self.initial_lora = self.learner.lora_parameters()
        source = preflight.open_task(cfg, self.learner.tokenizer, self.learner.model.config)  # checked whole
        self.task_report = source.report
        if source.report is not None:
            r = source.report
            self.log.write("task_source", records=r.records, skipped=r.skipped, skipped_long=r.skipped_long,
                           skipped_columns=r.skipped_columns, longest_prompt_tokens=r.longest_prompt_tokens,
                           examples=r.examples)
            self.out(f"task {cfg.task}: {r.records} records, longest prompt {r.longest_prompt_tokens} tokens"
                     + (f"; skipped {r.skipped} too large (first: {r.examples[0]})" if r.skipped else ""))
        self.reward_packages = task_reward_packages(source, cfg)  # every volunteer must have them (handshake)
        if self.reward_packages:
            self.out("reward packages volunteers need: " + ", ".join(
                f"{n}=={v}" for n, v in handshake_package_versions(self.reward_packages)))
        self.task_source = source

    def _build_intake(self) -> None:
        """Everything a lease request or a submitted batch goes through, up to the learner's queue."""
        cfg, source, pin = self.cfg, self.task_source, self.base.pin
        self.board = TaskBoard(source, lease_timeout_s=cfg.lease_timeout_s,
                               max_leases_per_client=cfg.max_leases_per_client,
                               lease_max_s=cfg.lease_max_s or cfg.lease_timeout_s,
                               prompt_max_failures=cfg.prompt_max_failures,
                               records=source.report.records if source.report is not None else 0)
        self.journal = IngestJournal(self.run_dir / "journal")
        self.access = AccessControl(AccessPolicy.from_config(cfg))  # who may talk, how often; strikes, bans
        self.board.standing = self.access.has_accepted  # reports of proven keys weigh more (poison retirement)
        self.node.inbound.trusted = self.access.peer_has_accepted  # their requests may use the whole byte budget
        self.auditor = Auditor.from_config(cfg, self.learner)  # logprob audit; shares the learner's base weights
        self.auditor.policy.on_event = self._audit_event  # an engine class starts / ends learning its tolerance
        self.receipts = ReceiptDesk(self.identity, cfg.run_id, self.run_dir / "receipts.bin")  # signed proof per ack
        self.ingest = Ingest(identity_public_key=self.identity.public_key, run_id=cfg.run_id, board=self.board,
                             tokenizer=self.learner.tokenizer, vocab_size=self.learner.vocab_size,
                             current_version=lambda: self.learner.version,
                             is_published=lambda v: self.publish_worker.is_published(v),
                             max_batch_bytes=cfg.max_batch_bytes,
                             window_s=cfg.timestamp_window_s, journal=self.journal, access=self.access,
                             seen_path=self.run_dir / "seen_ids.log", audit_queue=cfg.audit_queue,
                             auditor=self.auditor, receipts=self.receipts, sampling=messages.SamplingParams(
                                 temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, top_p=cfg.top_p,
                                 top_k=max(cfg.top_k, 0), min_p=cfg.min_p,
                                 repetition_penalty=cfg.repetition_penalty),
                             stop_token_ids=pin.stop_token_ids,  # finish reasons are derived from the tokens
                             context_limit=getattr(self.learner.model.config, "max_position_embeddings", None))
        self.auditor.attach(self.ingest)
        self.sync_round = None
        if cfg.sync:  # the synchronous baseline (benchmarks): coordinator/leasing/sync_round.py
            self.sync_round = SyncRound(self.ingest, self.board, live_s=cfg.lease_timeout_s)
        self.quorum = VolunteerQuorum(cfg.wait_for_volunteers, on_event=self._quorum_event)
        self.lease_desk = LeaseDesk(LeasePolicy.from_config(cfg), audience=self.identity.public_key, board=self.board,
                                    ingest=self.ingest, access=self.access, tokenizer=self.learner.tokenizer,
                                    current_version=lambda: self.publish_worker.published_version,
                                    sync_round=self.sync_round, quorum=self.quorum, gate=GatePolicy.from_config(cfg),
                                    on_reward_error=self._reward_error)
        self.completion_log = CompletionLog(self.run_dir / "completions.jsonl", self.learner.tokenizer,
                                            every=cfg.log_completions_every, count=cfg.log_completions_count)

    def _build_publishing(self) -> None:
        """The publisher and what restores the run: checkpoints (--resume), audit tolerances, trust state."""
        cfg, pin = self.cfg, self.base.pin
        self.publisher = Publisher(self.identity, run_id=cfg.run_id, base_model=self.base_model,
                                   base_revision=self.base_revision, lora=self.lora,
                                   keyframe_every=cfg.keyframe_every, chunk_bytes=cfg.chunk_bytes,
                                   base_weights_sha256=pin.weights_sha256, tokenizer_sha256=pin.tokenizer_sha256,
                                   stop_token_ids=pin.stop_token_ids,
                                   max_context_tokens=preflight.context_needed(self.task_source, cfg.max_new_tokens))
        self.providers.source = self.publisher  # what a seeder's service check must return (swarm/seeder_service.py)
        self.gate = checkpoint.Gate()  # lease/submit handlers vs. a checkpoint snapshot
        self.checkpoints = checkpoint.Checkpointing(
            self.run_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints, gate=self.gate, learner=self.learner,
            board=self.board, ingest=self.ingest, journal=self.journal, out=self.out, resume=cfg.resume,
            held=self.sync_round.held if self.sync_round is not None else None, auditor=self.auditor,
            identity=checkpoint.identity_meta(run_id=cfg.run_id, base_model=self.base_model,
                                              base_revision=self.base_revision, lora=self.lora),
            export=checkpoint.AdapterExport.of_base(self.lora, self.base.path, pin))  # + a standard PEFT directory
        if cfg.resume:
            info = self.checkpoints.resume()
            self.log.write("resume", **info)
            self.out(f"resumed from {info['checkpoint']} (step {info['from_step']}); publishing v{info['version']}, "
                     f"{info['replayed_batches']} journalled batches re-queued")
        if cfg.resume:  # engine classes learned before the restart keep their tolerance
            learned = self.auditor.policy.load_state(read_json(self.run_dir / AUDIT_ENGINES_FILE, {}))
            if learned:
                self.out("audit tolerance per engine class (resumed): " + _engines_line(self.auditor.engines_status()))
        self.trust = TrustState(self.run_dir, ingest=self.ingest, access=self.access, auditor=self.auditor,
                                lease_desk=self.lease_desk, engines_file=AUDIT_ENGINES_FILE,
                                every_s=cfg.trust_state_every_s, out=self.out)
        self.trust.load()  # replay.bin / access.bin: nonces, batch ids, bans and track records outlive a restart
        if cfg.resume:
            back = self.board.recheck_retired()  # retirements whose reporters lost their standing come back
            if back:
                self.out(f"{back} retired records back in the task (their reports no longer weigh enough)")
        # Everything up to learner.version - 1 may be held by volunteers (a resumed run's lineage).
        self.publish_worker = PublishWorker(self.publisher, self.pointer, before_visible=self._before_visible,
                                            on_published=self._on_published,
                                            published_floor=self.learner.version - 1, out=self.out)

    # ---- start-up ---------------------------------------------------------------------------
    def start(self) -> str:
        """Serve the built components, publish the first version, print how to join. The join address."""
        if not self.built:
            self.build_components()
        cfg = self.cfg
        self.trust.start()
        self.publish_worker.start()
        # The handlers need the learner's tokenizer and the task, so they come up after the model loads (the
        # node must start first: the DHT forks). Until then volunteers' streams are refused by p2pd ("protocols
        # not supported"), which they retry soon (client/pacing.py ReconnectBackoff, class "starting").
        self._serve_handlers()
        self.log.write("serving", after_node_s=round(time.monotonic() - self.node_up, 3))
        self._publish()
        # The first version is servable before the join address is announced (the DHT store may lag).
        if not self.publish_worker.wait_published(self.learner.version):
            raise RuntimeError(f"could not publish the first adapter version v{self.learner.version} (see above)")
        addrs = [a for a in (cfg.announce or self.node.visible_maddrs())]
        addrs = [a if "/p2p/" in a else f"{a}/p2p/{self.node.peer_id}" for a in addrs]
        self.join_address = addrs[0]
        (self.run_dir / "join.txt").write_text(self.join_address + "\n")
        self.out(f"coordinator {self.identity.fingerprint}  run {cfg.run_id}  model {self.base_model}")
        self.out("volunteers join with:")
        for a in addrs:
            self.out(f"  asyncrl-client join {a}")
        for peer in cfg.initial_peers:
            self.out(f"  asyncrl-client join {peer} --coordinator {self.node.peer_id}")
        self.out(f"  (or from any volunteer's address: asyncrl-client join <its address> --coordinator {self.node.peer_id})")
        self.telemetry.start_dashboard(self.snapshot)
        self.quorum.start()
        return self.join_address

    def _quorum_event(self, event: str, **fields) -> None:
        self.log.write(event, **fields)
        if event == "waiting_for_volunteers":
            self.out(f"waiting for {fields['joined']}/{fields['needed']} volunteers before training "
                     "(--wait-for-volunteers)")
        elif event == "volunteer_in":
            self.out(f"volunteer {fields['name'] or fields['fingerprint']} in ({fields['joined']}/{fields['needed']})")
        elif event == "volunteers_ready":
            self.out(f"all {fields['needed']} volunteers in; training starts")

    async def _announced_ports(self, peer: str) -> set[int]:
        """The TCP ports `peer`'s libp2p node announces (its identify addresses in our daemon's peer store): the
        only ports a NAT dial-back may try besides the one it is seen connecting from
        (coordinator/leasing/handshake.py)."""
        for info in await self.node.p2p.list_peers():
            if info.peer_id.to_base58() == peer:
                return {int(p) for a in info.addrs for p in re.findall(r"/tcp/(\d+)", str(a))}
        return set()

    def _proven_peer(self, peer: str) -> bool:
        access = getattr(self, "access", None)  # built after the swarm side starts
        return access is not None and access.peer_has_accepted(peer)

    def _audit_event(self, event: str, **fields) -> None:
        """An engine class joined (its tolerance is being learned) or finished learning (audit_policy.py)."""
        self.log.write(event, **fields)
        if event == "audit_engine_learning":
            self.out(f"audit: engine {fields['engine']} joined; learning its tolerance from its first "
                     f"{fields['needed']} audited batches (meanwhile {fields['ceiling']:.2g} nats/token, no strikes)")
        elif event == "audit_engine_learned":
            self.out(f"audit: engine {fields['engine']} learned tolerance {fields['tolerance']:.2e} from "
                     f"{fields['samples']} batches (0.95 quantile {fields['quantile']:.2e}, worst {fields['worst']:.2e})")

    def _serve_handlers(self) -> None:
        cfg, node = self.cfg, self.node

        def lease_or_finished(request: bytes, peer: str) -> bytes:  # under the gate: finishing waits for it
            self.run_end.seen(peer)
            if self.run_end.finished:
                self.run_end.told(peer)
                raise ProtocolError(RejectCode.RUN_FINISHED, self._finished_detail())
            return self.lease_desk.handle(request, peer)

        def ingest_or_finished(request: bytes, peer: str) -> messages.Ack:
            self.run_end.seen(peer)
            if self.run_end.finished:  # it could no longer be trained: the volunteer drops it
                self.run_end.told(peer)
                return messages.Ack(batch_id=b"", accepted=False, code=RejectCode.RUN_FINISHED.value,
                                    detail=self._finished_detail())
            return self.ingest.handle(request, peer)

        async def lease(request: bytes, peer: str) -> bytes:  # bounded pool: a full queue is RATE_LIMITED
            return await node.run_blocking(self.gate.run, lease_or_finished, request, peer)

        async def submit(request: bytes, peer: str) -> bytes:
            ack = await node.run_blocking(self.gate.run, ingest_or_finished, request, peer)
            return messages.encode(ack)

        self.handshake = HandshakeDesk(run_id=cfg.run_id, gate=GatePolicy.from_config(cfg),
                                       window_s=cfg.timestamp_window_s, max_staleness=cfg.max_staleness,
                                       lease_timeout_s=cfg.lease_timeout_s, pointer=lambda: self.pointer.last,
                                       finished=lambda: self.run_end.finished, announced_ports=self._announced_ports,
                                       environment=environment_pin(cfg.task),
                                       reward_packages=self.reward_packages, on_refusal=self._refused_at_door)

        def admit_info(peer: str) -> None:  # banned peers, then the peer's own handshake bucket
            self.access.check_peer(peer)
            self.handshake.admit(peer)

        node.serve(streams.INFO, self.handshake.handle, max_request_bytes=MAX_INFO_REQUEST_BYTES, with_addr=True,
                   admit=admit_info)
        # manifest + chunk handlers: banned peers refused; keys with accepted batches served first (docs/transport.md)
        self.serve_budget = ServeBudget(trusted=self.access.peer_has_accepted, stranger_bps=cfg.serve_new_bps,
                                        stranger_peer_bps=cfg.serve_new_peer_bps)
        self.adapter_server = AdapterServer(node, cfg.run_id, self.publisher, admit=self.access.check_peer,
                                            budget=self.serve_budget).start()
        node.serve(stream_name(cfg.run_id, streams.LEASE), lease, max_request_bytes=MAX_LEASE_REQUEST_BYTES,
                   admit=self.access.admit_peer)
        node.serve(stream_name(cfg.run_id, streams.SUBMIT), submit, max_request_bytes=cfg.max_batch_bytes,
                   admit=self.access.admit_peer)

    # ---- publishing -------------------------------------------------------------------------
    def _publish(self) -> None:
        """Learner thread: copy the live LoRA weights to CPU in the publish dtype and hand them to the
        publisher thread (never blocks; a version still waiting there is superseded)."""
        self.publish_worker.submit(export_version(self.learner, self.cfg.publish_dtype))

    def _on_published(self, record: dict) -> None:
        self.lease_desk.versions.published()  # the publish interval sizes leases (coordinator/leasing/leasing.py)
        self.log.write("publish", **record)

    def _before_visible(self, export) -> None:
        """Publisher thread, before a version can reach any volunteer: the audit copy, then lineage.json
        (a resumed run numbers its versions above it)."""
        self.auditor.remember_published(export.version, export.specs, export.blobs, export.learner_steps)
        checkpoint.record_published(self.run_dir, export.version)

    # ---- learner loop -----------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        logged = 0
        self.quorum.wait(self.stop)  # --wait-for-volunteers: no step before N volunteers are in (returns at once by default)
        waited = 0.0  # the learner's wait for data since its last step (coordinator/operator/capacity.py)
        while (not self.stop.is_set() and (cfg.max_steps == 0 or self.learner.steps < cfg.max_steps)
               and not self.run_end.requested()):
            if self.sync_round is not None:
                items = self.sync_round.take(self.learner.version, self.stop)
            else:
                t0 = time.monotonic()
                items = self.ingest.take(cfg.groups_per_step, max_wait_s=cfg.max_wait_s, min_groups=cfg.min_groups,
                                         stop=self.stop)
                waited += time.monotonic() - t0
            new = self.ingest.accepted_since(logged)
            if new and new[0].seq > logged:  # more arrived than the log keeps: say how many events are missing
                self.log.write("batch_events_skipped", count=new[0].seq - logged)
            logged = new[-1].seq + 1 if new else logged
            for b in new:
                self.capacity.accepted(b.client, b.groups)
                self.log.write("batch", client=b.client, version=b.version, reward_mean=b.reward_mean,
                               groups=b.groups, staleness=self.learner.version - b.version,
                               batch_id=b.batch_id.hex(), prompt_ids=list(b.prompt_ids))
            if not items:
                continue
            groups = [g for item in items for g in item.groups]
            # the contributors table: whose groups the learner steps on (fresh before the step bumps the version)
            fresh = [(item.signer, sum(1 for g in item.groups if not self.learner.is_stale(g.version))) for item in items]
            trained = [g for g in groups if not self.learner.is_stale(g.version)]
            result = self.learner.step(groups)
            stale_dropped = len(groups) - (result.groups_used if result else 0)
            if stale_dropped:
                self.board.mark_dropped(stale_dropped)
            batch_ids = [item.batch_id.hex() for item in items]  # consumed exactly once (tests check this)
            if result is None:
                self.log.write("dropped", groups=stale_dropped, reason="stale", batch_ids=batch_ids)
                continue
            self.board.mark_trained(result.groups_used)
            self.capacity.learner_step(wait_s=waited, step_s=result.seconds, groups=len(groups),
                                       stale_dropped=stale_dropped)
            waited = 0.0
            for signer, used in fresh:
                self.trained_by[signer] = self.trained_by.get(signer, 0) + used
            self.auditor.learner_stepped(result.seconds)  # the audit's cost is reported against this
            self.log.write("step", step=self.learner.steps, version=self.learner.version, loss=result.loss,
                           reward_mean=result.reward_mean, groups=result.groups_used, dropped_stale=stale_dropped,
                           staleness=result.staleness, clip_fraction=result.clip_fraction,
                           ratio_mean=result.ratio_mean, seconds=result.seconds,
                           **{k: v for k, v in result.metrics.items() if k not in ("loss", "clip_fraction", "ratio_mean")},
                           tokens=result.tokens, clients=sorted({item.client for item in items}), **replay_metrics(),
                           dropped_total=self.board.counts()["dropped"], batch_ids=batch_ids,
                           **reward_stats(trained))  # TRL's rewards/<name>/mean and /std
            self.completion_log.after_step(self.learner.steps, trained)
            if self.learner.steps % cfg.publish_every == 0:
                self.learner.next_version()
                self._publish()
            if self.checkpoints.after_step():
                self.log.write("checkpoint", step=self.learner.steps, version=self.learner.version,
                               seconds=self.checkpoints.seconds)
            if self.learner.steps % 10 == 0:
                self.out(f"step {self.learner.steps:4d}  v{self.learner.version:<4d} reward {result.reward_mean:.3f}  "
                         f"loss {result.loss:+.4f}  groups {result.groups_used}  clients {self.ingest.clients_known()}")
        if not self.stop.is_set():  # max_steps reached or `asyncrl-coordinator finish`: over for good
            self._finish("max_steps" if cfg.max_steps and self.learner.steps >= cfg.max_steps else "finish requested")
        if self.checkpoints.final():  # max_steps reached, or SIGTERM/SIGINT set self.stop
            self.log.write("checkpoint", step=self.learner.steps, version=self.learner.version, final=True,
                           seconds=self.checkpoints.seconds)
        summary = self.summary()
        if self.run_end.finished:  # volunteers still polling the DHT through us learn it (coordinator/run_end.py)
            self.run_end.linger(cfg.finish_grace_s, self.stop)
        return summary

    def _refused_at_door(self, refusal: dict) -> None:
        """The handshake turned a volunteer away (version gate, missing reward package): no strike, no lease;
        the operator sees it (metrics.jsonl `handshake_refused`, the dashboard)."""
        who = f"peer …{refusal['peer'][-8:]} (asyncrl {refusal.get('client_version') or '?'})"
        self.handshake_refusals.add(who, f"{refusal['code']}: {refusal['detail']}", 0)
        self.log.write("handshake_refused", **refusal)

    def _reward_error(self, client: str, error: str, leases: int) -> None:
        """A volunteer's reward function raised on `leases` of its leases (LeaseRequest.reward_error): the
        operator sees it in metrics.jsonl, on the dashboard and on the console (each distinct error once)."""
        first = all(r["error"] != error for r in self.reward_errors.snapshot()["recent"])
        self.reward_errors.add(client, error, leases)
        self.log.write("reward_error", client=client, error=error, leases=leases)
        if first:
            self.out(f"warning: volunteer {client!r}: {error}")

    def _finish(self, reason: str) -> None:
        """End the run for good: refuse work with RUN_FINISHED and publish the final signed pointer."""
        with self.gate.closed():  # no lease or batch in flight: the summary's books stay balanced
            self.run_end.finish(reason)
        if not self.publish_worker.finish(timeout=FINAL_POINTER_WAIT_S):
            self.out("warning: the final pointer is not stored yet; volunteers learn the end from RUN_FINISHED")
        self.log.write("finished", reason=reason, step=self.learner.steps, version=self.learner.version)
        self.out(f"run {self.cfg.run_id} finished ({reason}) at step {self.learner.steps}, v{self.learner.version}")

    def _finished_detail(self) -> str:
        return (f"run {self.cfg.run_id!r} finished ({self.run_end.reason}) at step {self.learner.steps}, "
                f"adapter v{self.learner.version}")

    def summary(self) -> dict:
        final = self.learner.lora_parameters()
        delta = sum(float((final[k] - self.initial_lora[k]).float().norm() ** 2) for k in final) ** 0.5
        books = self.ingest.books()
        summary = {
            "run_id": self.cfg.run_id,
            "finished": self.run_end.finished,  # over for good (max_steps / finish); False after Ctrl-C (resumable)
            "trainer_steps": self.learner.steps,
            "adapter_versions_published": self.publish_worker.published,  # by this process (superseded: not)
            "publisher": self.publish_worker.stats(),
            "batches_accepted": books.accepted_total,
            "batches_by_client": {c["name"]: c["accepted"] for c in books.clients if c["accepted"]},
            "receipts": self.receipts.summary(),  # per volunteer fingerprint: what its signed receipts add up to
            "contributors": self.contributors(books),  # the dashboard's contributors table
            "rejected_by_client": {c["name"]: c["rejected"] for c in books.clients if c["rejected"]},
            "groups_unscorable": books.unscorable_groups,
            "reward_first": books.reward_first,  # mean batch reward over the first / last 10 % of accepted batches
            "reward_last": books.reward_last,
            "lora_delta_norm": delta,
            **self._lease_books(),
            "task": dataclasses.asdict(self.task_report) if getattr(self, "task_report", None) else None,
            "wall_s": time.time() - self.t0,
            "torch_threads": torch.get_num_threads(),
            "presence": self.presence(),  # each volunteer's announced adapter version and lag
            "providers": self.providers.status(),  # the fetch sources we vouch for (swarm/providers.py)
            "presence_reads": {"rounds": self.presence_tracker.reads, **self.presence_tracker.read_stats},
            "adapter_uplink": {"bytes_sent": self.adapter_server.stats.bytes_sent,
                               "chunks_sent": self.adapter_server.stats.chunks_sent,
                               "manifests_sent": self.adapter_server.stats.manifests_sent,
                               "bytes_by_version": {str(v): n for v, n in
                                                    sorted(self.adapter_server.stats.bytes_by_version.items())[-64:]}},
        }
        write_json_atomic(self.run_dir / "summary.json", summary, indent=2)
        return summary

    def presence(self) -> list[dict]:
        """Volunteers' presence records (DHT): name, peer id, adapter version, lag, throughput, last seen."""
        tracker = getattr(self, "presence_tracker", None)
        return tracker.snapshot(self.learner.version) if tracker is not None else []

    def _lease_books(self) -> dict:
        """The task board's counters and their balance, at one instant (no lease/submit in flight)."""
        with self.gate.closed():
            return {"leases": self.board.counts(), "leases_balanced": self.board.balanced(self.ingest.queued()),
                    "retired_prompts": self.board.retired_prompt_ids()}

    def contributors(self, books: IngestBooks | None = None) -> list[dict]:
        """Who contributed what, publishable (names and key fingerprints, no addresses): accepted batches and
        tokens as their signed receipts say (coordinator/ingest/receipts.py), and each one's share of the groups
        the learner trained on in this process."""
        receipted = self.receipts.summary()
        names = {c["fingerprint"]: c["name"] for c in (books or self.ingest.books()).clients}
        trained = dict(self.trained_by)
        total = sum(trained.values())
        rows = [{"name": names.get(fp, fp), "fingerprint": fp, "accepted_batches": r["batches"],
                 "accepted_tokens": r["tokens"], "trained_groups": trained.get(fp, 0),
                 "trained_share": trained.get(fp, 0) / total if total else 0.0} for fp, r in receipted.items()]
        return sorted(rows, key=lambda r: (-r["accepted_tokens"], r["fingerprint"]))

    def snapshot(self) -> dict:
        """Read-only status for the dashboard, /metrics and `asyncrl-coordinator status`; no secrets."""
        books = self.ingest.books()
        identity = {"fingerprint": self.identity.fingerprint, "peer_id": self.identity.peer_id,
                    "join_address": getattr(self, "join_address", None), "model": self.base_model}
        worker = getattr(self, "publish_worker", None)
        return self.telemetry.snapshot_part(version=self.learner.version, steps=self.learner.steps,
                                            clients=books.clients, leases=self.board.counts(),
                                            queued_groups=books.queued_groups, identity=identity,
                                            presence=self.presence(), contributors=self.contributors(books),
                                            publisher=worker.stats() if worker is not None else None,
                                            waiting=self.quorum.status(), audit=self._audit_snapshot(),
                                            completions=self.completion_log.latest() if hasattr(self, "completion_log") else [],
                                            reward_errors=self.reward_errors.snapshot(),
                                            handshake_refusals=self.handshake_refusals.snapshot(),
                                            capacity=self.capacity.snapshot())

    def _audit_snapshot(self) -> dict | None:
        auditor = getattr(self, "auditor", None)
        if auditor is None or not auditor.enabled:
            return None
        queue = self.ingest.audits.status() if getattr(self, "ingest", None) is not None and self.ingest.audits else None
        return {"engines": auditor.engines_status(), "base_tolerance": auditor.tolerance, "queue": queue,
                **{k: auditor.stats[k] for k in ("audited", "passed", "failed", "skipped")}}

    def shutdown(self) -> None:
        self.stop.set()
        self.telemetry.close()  # dashboard down, final reward.png, trackers closed; never raises
        if getattr(self, "ingest", None) is not None:
            self.ingest.close()  # the audit worker; batches still waiting are journalled (--resume audits them)
        if getattr(self, "trust", None) is not None:
            self.trust.stop()  # last trust.json / replay.bin
        # A waiting version is abandoned (the final checkpoint holds it; --resume publishes above it).
        worker = getattr(self, "publish_worker", None)
        if worker is not None and not worker.close():
            self.out("warning: the publisher thread is still storing a pointer; shutting the DHT down under it")
        for part in ("providers", "presence_tracker"):
            if getattr(self, part, None) is not None:
                getattr(self, part).stop()
        try:
            if getattr(self, "node", None) is not None:
                self.node.shutdown()
        finally:
            self.log.close()


def inbound_limits(cfg: CoordinatorConfig):
    """The coordinator's inbound budgets (swarm/inbound.py) from its config."""
    return InboundLimits(max_inflight_bytes=cfg.inbound_bytes,
                         max_inflight_bytes_per_peer=max(2 * cfg.max_batch_bytes, cfg.inbound_bytes // 8),
                         max_streams_per_peer=cfg.max_streams_per_peer, min_read_bps=cfg.min_upload_bps,
                         workers=cfg.handler_threads, queue=cfg.handler_queue)


def _engines_line(engines: dict[str, dict]) -> str:
    return ", ".join(f"{cls} {e['tolerance']:.2e} ({e['state']}, {e['samples']}/{e['needed']})"
                     for cls, e in engines.items()) or "none yet"


def _saved_peers(path: Path) -> dict[str, list[str]]:
    data = read_json(path, {})
    peers = data.get("peers") if isinstance(data, dict) else None
    return peers if isinstance(peers, dict) else {}


def install_signal_handlers(stop: threading.Event) -> None:
    signals.install(lambda signum: stop.set())
