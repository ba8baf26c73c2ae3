"""Coordinator hub: wires the components and runs the learner loop.

Components (each has one job; none references this hub):
  SwarmNode   (asyncrl.transport)  hivemind DHT + P2P streams; serves the handlers below
  Publisher   adapter -> codec -> signed manifest + chunks; signed pointer stored in the DHT
  TaskBoard   prompt leases, expiry and re-leasing
  Ingest      verify + decode + re-score signed rollout batches; bounded queue to the learner
  Learner     GRPO steps on the LoRA adapter; owns the version counter
  RunLog      metrics.jsonl + summary.json in the run directory

P2P handlers (stream names are scoped by run id): `manifest` (version -> sealed manifest),
`chunk` (version, index -> bytes), `lease` (sealed LeaseRequest -> LeaseGrant), `submit`
(sealed RolloutBatch -> Ack). Handlers run on the P2P loop thread and push blocking work
(verification, tokenizer) to a thread pool; the learner runs on the main thread.

    asyncrl-coordinator run --model tiny --max-steps 150
"""

from __future__ import annotations

import asyncio
import json
import signal
import struct
import threading
import time
from pathlib import Path

from asyncrl.coordinator.config import CoordinatorConfig
from asyncrl.protocol import envelope, limits, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity

POINTER_REFRESH_S = 60.0


def handler_name(run_id: str, what: str) -> str:
    return f"asyncrl.{run_id}.{what}"


def resolve_model(model: str) -> tuple[str, str, str]:
    """(path to load, name to publish, revision). "tiny" is built locally and pinned by weight hash."""
    from asyncrl import tinymodel

    if model in ("tiny", tinymodel.TINY_MODEL_NAME):
        path = tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir())
        return str(path), tinymodel.TINY_MODEL_NAME, tinymodel.weights_revision(path)
    return model, model, "main"


class RunLog:
    """Append-only JSONL metrics (one event per line, flushed) in the run directory."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: str, **fields) -> None:
        with self._lock:
            self._f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")

    def close(self) -> None:
        self._f.close()


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig, *, out=print):
        self.cfg = cfg.validate()
        self.out = out
        self.stop = threading.Event()
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.write(self.run_dir)
        self.identity, created = Identity.load_or_create(self.run_dir / "coordinator.key")
        self.identity.write_libp2p_identity(self.run_dir / "p2p.identity")
        self.log = RunLog(self.run_dir / "metrics.jsonl")
        self.t0 = time.time()

    # ---- start-up ---------------------------------------------------------------------------
    def start(self) -> str:
        from asyncrl.transport import SwarmNode

        cfg = self.cfg
        # The DHT forks: create it before torch spins up threads or CUDA.
        self.node = SwarmNode(host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"], announce_maddrs=cfg.announce or None,
                              identity_path=str(self.run_dir / "p2p.identity"))
        assert self.node.peer_id == self.identity.peer_id, "p2pd did not adopt the coordinator key"

        from asyncrl import tasks
        from asyncrl.coordinator.ingest import Ingest
        from asyncrl.coordinator.learner import Learner
        from asyncrl.coordinator.publisher import Publisher
        from asyncrl.coordinator.taskboard import TaskBoard

        path, self.base_model, self.base_revision = resolve_model(cfg.model)
        self.lora = messages.LoraSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                      target_modules=tuple(cfg.lora_targets))
        self.learner = Learner(path, self.lora, lr=cfg.lr, loss=cfg.loss, max_staleness=cfg.max_staleness, seed=cfg.seed)
        self.initial_lora = self.learner.lora_parameters()
        self.board = TaskBoard(tasks.get_task(cfg.task, cfg.seed), lease_timeout_s=cfg.lease_timeout_s,
                               max_leases_per_client=cfg.max_leases_per_client)
        self.ingest = Ingest(identity_public_key=self.identity.public_key, run_id=cfg.run_id, board=self.board,
                             tokenizer=self.learner.tokenizer, vocab_size=self.learner.vocab_size,
                             current_version=lambda: self.learner.version, max_batch_bytes=cfg.max_batch_bytes,
                             window_s=cfg.timestamp_window_s)
        self.publisher = Publisher(self.identity, run_id=cfg.run_id, base_model=self.base_model,
                                   base_revision=self.base_revision, lora=self.lora,
                                   keyframe_every=cfg.keyframe_every, chunk_bytes=cfg.chunk_bytes)
        self._serve_handlers()
        self._publish()
        threading.Thread(target=self._refresh_pointer, name="pointer-refresh", daemon=True).start()
        addrs = [a for a in (cfg.announce or self.node.visible_maddrs())]
        addrs = [a if "/p2p/" in a else f"{a}/p2p/{self.node.peer_id}" for a in addrs]
        self.join_address = addrs[0]
        (self.run_dir / "join.txt").write_text(self.join_address + "\n")
        self.out(f"coordinator {self.identity.fingerprint}  run {cfg.run_id}  model {self.base_model}")
        self.out("volunteers join with:")
        for a in addrs:
            self.out(f"  asyncrl-client join {a}")
        return self.join_address

    def _serve_handlers(self) -> None:
        cfg, node = self.cfg, self.node
        loop = node.loops.loop

        async def manifest(request: bytes, peer: str) -> bytes:
            if len(request) != 8:
                raise ProtocolError(RejectCode.MALFORMED, "manifest request is a u64 version")
            pub = self.publisher.get(struct.unpack(">Q", request)[0])
            if pub is None:
                raise ProtocolError(RejectCode.STALE_VERSION, "version not held any more")
            return pub.manifest_bytes

        async def chunk(request: bytes, peer: str) -> bytes:
            if len(request) != 12:
                raise ProtocolError(RejectCode.MALFORMED, "chunk request is (u64 version, u32 index)")
            version, index = struct.unpack(">QI", request)
            pub = self.publisher.get(version)
            if pub is None or index >= len(pub.chunks):
                raise ProtocolError(RejectCode.STALE_VERSION, "chunk not held")
            return pub.chunks[index]

        async def lease(request: bytes, peer: str) -> bytes:
            return await loop.run_in_executor(None, self._lease, request)

        async def submit(request: bytes, peer: str) -> bytes:
            ack = await loop.run_in_executor(None, self.ingest.handle, request)
            return messages.encode(ack)

        async def info(request: bytes, peer: str) -> bytes:
            return cfg.run_id.encode()

        node.serve("asyncrl.info", info, max_request_bytes=64)
        node.serve(handler_name(cfg.run_id, "manifest"), manifest, max_request_bytes=64)
        node.serve(handler_name(cfg.run_id, "chunk"), chunk, max_request_bytes=64)
        node.serve(handler_name(cfg.run_id, "lease"), lease, max_request_bytes=64 * 1024)
        node.serve(handler_name(cfg.run_id, "submit"), submit, max_request_bytes=cfg.max_batch_bytes)

    def _lease(self, request: bytes) -> bytes:
        opened = envelope.open_envelope(request, max_bytes=64 * 1024, expected_kind="lease_request",
                                        expected_audience=self.identity.public_key,
                                        window_s=self.cfg.timestamp_window_s)
        req = messages.decode(opened.payload, messages.LeaseRequest, max_bytes=64 * 1024)
        if req.run_id != self.cfg.run_id:
            raise ProtocolError(RejectCode.WRONG_RUN, f"this coordinator runs {self.cfg.run_id!r}")
        with self.ingest.lock:
            queued = self.ingest.queued_groups
        room = self.cfg.max_inflight_groups - queued - self.board.counts()["outstanding"]
        grants = self.board.lease(opened.signer, max(0, min(req.max_prompts, self.cfg.prompts_per_lease, room)))
        sampling = messages.SamplingParams(temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens)
        tok = self.learner.tokenizer
        leases = tuple(messages.TaskLease(
            lease_id=g.lease_id, prompt_id=g.prompt.prompt_id, prompt=g.prompt.text,
            prompt_token_ids=_int32_bytes(tok(g.prompt.text)["input_ids"]), answer=g.prompt.answer,
            reward=g.prompt.reward, group_size=self.cfg.group_size, sampling=sampling, expires_at=g.expires_at)
            for g in grants)
        with self.ingest.lock:
            self.ingest._client(opened.signer, req.client_name)
        return messages.encode(messages.LeaseGrant(run_id=self.cfg.run_id, leases=leases,
                                                   current_version=self.learner.version))

    # ---- publishing -------------------------------------------------------------------------
    def _publish(self) -> None:
        from asyncrl.coordinator.publisher import POINTER_TTL_S, pointer_key
        from asyncrl.lora import export_lora

        specs, blobs = export_lora(self.learner.model, self.cfg.publish_dtype)
        pub = self.publisher.publish(self.learner.version, specs, blobs)
        self.node.store(pointer_key(self.cfg.run_id), pub.pointer_bytes, POINTER_TTL_S)
        self.log.write("publish", version=pub.version, codec=pub.codec, compressed_bytes=pub.compressed_bytes,
                       raw_bytes=pub.raw_bytes)

    def _refresh_pointer(self) -> None:
        from asyncrl.coordinator.publisher import POINTER_TTL_S, pointer_key

        while not self.stop.wait(POINTER_REFRESH_S):
            latest = self.publisher.latest
            if latest is not None:
                try:
                    self.node.store(pointer_key(self.cfg.run_id), latest.pointer_bytes, POINTER_TTL_S)
                except Exception as exc:  # keep refreshing; the DHT may be briefly unhappy
                    self.out(f"warning: pointer refresh failed: {exc}")

    # ---- learner loop -----------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        logged = 0
        while not self.stop.is_set() and (cfg.max_steps == 0 or self.learner.steps < cfg.max_steps):
            items = self.ingest.take(cfg.groups_per_step, max_wait_s=cfg.max_wait_s, min_groups=cfg.min_groups,
                                     stop=self.stop)
            with self.ingest.lock:
                new = self.ingest.accepted_log[logged:]
                logged = len(self.ingest.accepted_log)
            for b in new:
                self.log.write("batch", client=b.client, version=b.version, reward_mean=b.reward_mean,
                               groups=len(b.groups), staleness=self.learner.version - b.version)
            if not items:
                continue
            groups = [g for item in items for g in item.groups]
            result = self.learner.step(groups)
            stale_dropped = len(groups) - (result.groups_used if result else 0)
            if stale_dropped:
                self.board.mark_dropped(stale_dropped)
            if result is None:
                self.log.write("dropped", groups=stale_dropped, reason="stale")
                continue
            self.log.write("step", step=self.learner.steps, version=self.learner.version, loss=result.loss,
                           reward_mean=result.reward_mean, groups=result.groups_used, dropped_stale=stale_dropped,
                           staleness=result.staleness, clip_fraction=result.clip_fraction,
                           ratio_mean=result.ratio_mean, seconds=result.seconds)
            if self.learner.steps % cfg.publish_every == 0:
                self.learner.version += 1
                self._publish()
            if self.learner.steps % 10 == 0:
                self.out(f"step {self.learner.steps:4d}  v{self.learner.version:<4d} reward {result.reward_mean:.3f}  "
                         f"loss {result.loss:+.4f}  groups {result.groups_used}  clients {len(self.ingest.clients)}")
        return self.summary()

    def summary(self) -> dict:
        import torch

        final = self.learner.lora_parameters()
        delta = sum(float((final[k] - self.initial_lora[k]).float().norm() ** 2) for k in final) ** 0.5
        with self.ingest.lock:
            log = list(self.ingest.accepted_log)
            clients = {st.name: st.accepted for st in self.ingest.clients.values()}
            rejected = {st.name: dict(st.rejected) for st in self.ingest.clients.values() if st.rejected}
        k = max(1, len(log) // 10)
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0
        summary = {
            "run_id": self.cfg.run_id,
            "trainer_steps": self.learner.steps,
            "adapter_versions_published": self.learner.version + 1,
            "batches_accepted": len(log),
            "batches_by_client": clients,
            "rejected_by_client": rejected,
            "reward_first": mean([b.reward_mean for b in log[:k]]),
            "reward_last": mean([b.reward_mean for b in log[-k:]]),
            "lora_delta_norm": delta,
            "leases": self.board.counts(),
            "wall_s": time.time() - self.t0,
            "torch_threads": torch.get_num_threads(),
        }
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.run_dir / "summary.json")
        return summary

    def shutdown(self) -> None:
        self.stop.set()
        try:
            self.node.shutdown()
        finally:
            self.log.close()


def _int32_bytes(ids) -> bytes:
    import numpy as np

    return np.asarray(ids, dtype="<i4").tobytes()


def install_signal_handlers(stop: threading.Event) -> None:
    def handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
