"""Volunteer hub: join, follow the adapter, generate, score, sign, spool, upload.

Components (one job each; none references this hub):
  SwarmNode    (asyncrl.transport)  hivemind DHT + P2P streams to the coordinator
  AdapterSync  watch the signed pointer, fetch + verify + decode adapter versions
  Engine       generation with per-token sampling logprobs (transformers; vLLM plugs in here)
  Outbox       sealed batches on disk until acked
  status.json  what this volunteer did (for `asyncrl-client status` and tests)

Loop: poll the pointer (hot-swap a newer adapter between batches) -> lease prompts -> generate G
completions each -> score -> seal a RolloutBatch for the coordinator -> outbox -> upload -> delete on ack.

    asyncrl-client join /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity, public_key_from_peer_id

# Codes after which re-sending the same bytes can never succeed: drop the spooled copy.
FINAL_REJECTS = {c.value for c in RejectCode} - {RejectCode.RATE_LIMITED.value, RejectCode.INTERNAL.value}


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


@dataclass
class VolunteerStatus:
    name: str
    fingerprint: str
    versions_loaded: list[int] = field(default_factory=list)
    batches_sent: int = 0
    batches_acked: int = 0
    batches_rejected: dict[str, int] = field(default_factory=dict)
    rollouts: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    started_at: float = field(default_factory=time.time)


class Volunteer:
    def __init__(self, cfg: VolunteerConfig, *, out=print):
        from asyncrl.transport import parse_join_address

        self.cfg = cfg
        self.out = out
        self.stop = threading.Event()
        self.addr = parse_join_address(cfg.address)  # BadAddress before anything starts
        self.coordinator_key = public_key_from_peer_id(self.addr.peer_id)
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.identity, created = Identity.load_or_create(cfg.data_dir / "identity.key")
        if created:
            out(f"created volunteer identity {self.identity.fingerprint} in {cfg.data_dir / 'identity.key'}")
        self.name = cfg.name or f"volunteer-{self.identity.fingerprint[:9].replace(':', '')}"
        from asyncrl.client.outbox import Outbox

        self.outbox = Outbox(cfg.data_dir / "outbox")
        self.status = VolunteerStatus(name=self.name, fingerprint=self.identity.fingerprint)
        self.run_id: str | None = None

    # ---- start-up ---------------------------------------------------------------------------
    def connect(self, run_id: str | None = None, timeout: float = 60.0) -> None:
        from asyncrl.client.adapter_sync import AdapterSync
        from asyncrl.transport import SwarmNode, check_reachable

        check_reachable(self.addr)
        self.node = SwarmNode(initial_peers=[self.addr.maddr], client_mode=self.cfg.client_mode)
        self.run_id = run_id or self._discover_run_id(timeout)
        self.sync = AdapterSync(self.node, coordinator_peer_id=self.addr.peer_id, coordinator_key=self.coordinator_key,
                                run_id=self.run_id)

    def _discover_run_id(self, timeout: float) -> str:
        """The coordinator answers `asyncrl.info` with its run id (one coordinator per address)."""
        deadline = time.time() + timeout
        while True:
            try:
                return self.node.call(self.addr.peer_id, "asyncrl.info", b"", max_response_bytes=256,
                                      timeout=10).decode()
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(1.0)

    def wait_for_adapter(self, timeout: float = 120.0):
        deadline = time.time() + timeout
        while not self.stop.is_set():
            got = self.sync.poll()
            if got is not None:
                return got
            if time.time() > deadline:
                raise TimeoutError("no adapter published by the coordinator yet")
            time.sleep(self.cfg.poll_s)

    def load_engine(self, manifest: messages.AdapterManifest):
        from asyncrl.client.engine import TransformersEngine
        from asyncrl import tinymodel

        model = self.cfg.model or manifest.base_model
        if model == tinymodel.TINY_MODEL_NAME:
            path = tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir())
            if tinymodel.weights_revision(path) != manifest.base_revision:
                raise RuntimeError(f"the built-in tiny model here ({tinymodel.weights_revision(path)}) differs from "
                                   f"the coordinator's ({manifest.base_revision}); refusing to serve it")
            model = str(path)
        self.engine = TransformersEngine(model, manifest.lora, seed=self.cfg.seed)

    # ---- main loop --------------------------------------------------------------------------
    def run(self) -> VolunteerStatus:
        current = self.wait_for_adapter()
        self.load_engine(current.manifest)
        self._load(current)
        self.flush()  # batches left from a previous run go first
        while not self.stop.is_set():
            if self.cfg.max_batches and self.status.batches_acked >= self.cfg.max_batches:
                break
            try:
                newer = self.sync.poll()
                if newer is not None:
                    self._load(newer)
                leases = self._lease()
                if not leases:
                    time.sleep(self.cfg.poll_s)
                    continue
                self._work(leases)
                self.flush()
            except ProtocolError as exc:
                self.out(f"warning: {exc.code.value}: {exc.detail}")
                time.sleep(self.cfg.poll_s)
            except Exception as exc:
                from asyncrl.transport import TransportError

                if not isinstance(exc, TransportError):
                    raise
                self.out(f"coordinator unreachable ({exc}); retrying")
                time.sleep(2.0)
            self._write_status()
        self.flush()
        self._write_status()
        return self.status

    def _load(self, adapter) -> None:
        self.engine.load_adapter(adapter.version, adapter.manifest.tensors, adapter.tensors)
        self.status.versions_loaded.append(adapter.version)
        if not self.cfg.quiet:
            self.out(f"[{self.name}] adapter v{adapter.version} loaded ({adapter.manifest.codec}, "
                     f"{adapter.manifest.compressed_bytes} bytes)")

    def _lease(self) -> list[messages.TaskLease]:
        req = messages.LeaseRequest(run_id=self.run_id, max_prompts=self.cfg.prompts_per_batch,
                                    adapter_version=self.sync.current.version, client_name=self.name)
        sealed = envelope.seal(self.identity, "lease_request", messages.encode(req), audience=self.coordinator_key)
        raw = self.node.call(self.addr.peer_id, f"asyncrl.{self.run_id}.lease", sealed, max_response_bytes=4 << 20)
        grant = messages.decode(raw, messages.LeaseGrant, max_bytes=4 << 20)
        return list(grant.leases)

    def _work(self, leases: list[messages.TaskLease]) -> None:
        from asyncrl import tasks

        sampling = leases[0].sampling
        group_size = leases[0].group_size
        prompts = [np.frombuffer(l.prompt_token_ids, dtype="<i4").tolist() for l in leases]
        version = self.sync.current.version
        samples = self.engine.generate(prompts, group_size, sampling)
        groups = []
        for lease, group in zip(leases, samples):
            comps = []
            for s in group:
                text = self.engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                reward = tasks.score(lease.reward, text, lease.answer)
                comps.append(messages.Completion(
                    token_ids=np.asarray(s.token_ids, dtype="<i4").tobytes(),
                    logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(), reward=reward,
                    finish_reason=s.finish_reason))
                self.status.rollouts += 1
                self.status.tokens += len(s.token_ids)
                self.status.reward_sum += reward
            groups.append(messages.RolloutGroup(lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                                                prompt_token_ids=lease.prompt_token_ids, completions=tuple(comps)))
        batch = messages.RolloutBatch(run_id=self.run_id, adapter_version=version, client_name=self.name,
                                      sampling=sampling, groups=tuple(groups), generated_at=time.time())
        payload = messages.encode(batch)
        sealed = envelope.seal(self.identity, "rollout_batch", payload, audience=self.coordinator_key)
        import hashlib

        self.outbox.put(hashlib.sha256(payload).digest(), sealed)

    def flush(self) -> None:
        """Upload every spooled batch; delete each only once the coordinator acked it."""
        for batch_id, sealed in self.outbox.pending():
            raw = self.node.call(self.addr.peer_id, f"asyncrl.{self.run_id}.submit", sealed,
                                 max_response_bytes=64 * 1024)
            ack = messages.decode(raw, messages.Ack, max_bytes=64 * 1024)
            self.status.batches_sent += 1
            if ack.accepted:
                self.status.batches_acked += 1
                self.outbox.remove(batch_id)
            else:
                self.status.batches_rejected[ack.code or "?"] = self.status.batches_rejected.get(ack.code or "?", 0) + 1
                if ack.code in FINAL_REJECTS:
                    self.outbox.remove(batch_id)
                if not self.cfg.quiet:
                    self.out(f"[{self.name}] batch rejected: {ack.code} {ack.detail}")

    def _write_status(self) -> None:
        path = self.cfg.data_dir / "status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(self.status), "outbox": len(self.outbox), "run_id": self.run_id}))
        os.replace(tmp, path)

    def shutdown(self) -> None:
        node = getattr(self, "node", None)
        if node is not None:
            node.shutdown()
