"""The publisher thread: a stalled DHT store never delays learner steps; the newest version wins.

Real Learner (tiny model), real Publisher, codec and PublishWorker, real lineage file, and a real
AdapterSync on the volunteer side. The network is replaced at its seams by small named fakes:
`StallingPointer` (the coordinator's DHT pointer store; blocks while the test holds it shut, like a DHT
store that takes seconds), `DhtValues` (what the DHT returns to a volunteer) and `PublisherFetcher`
(manifests and chunks straight from the Publisher, as AdapterServer serves them).
"""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl import tasks
from asyncrl.client.adapter_sync import AdapterSync
from asyncrl.coordinator.checkpoint import last_published, record_published
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.learner.learner import Learner, TrainGroup
from asyncrl.coordinator.learner.loss import LossConfig
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.coordinator.publisher import Publisher, PublishWorker, export_version
from asyncrl.models import tinymodel
from asyncrl.protocol import codec, envelope, messages, swarm
from asyncrl.protocol.identity import Identity

from . import rollouts

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
RUN = "pub"
LORA = messages.LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=8)
STALL_LIMIT_S = 120.0  # a stall the learner would have to sit out if it waited on the store


class StallingPointer:
    """The DHT pointer store, with a valve: while `shut`, `store` blocks (a slow DHT). Writes what it
    stored into `dht` (the volunteer's view), and records versions as stores begin and end."""

    identity = COORD  # PointerRecord's signing key (the run's final pointer is sealed by the worker)

    def __init__(self, dht: DhtValues):
        self.dht = dht
        self.open = threading.Event()
        self.open.set()
        self._cond = threading.Condition()
        self.begun: list[int] = []
        self.done: list[int] = []
        self.stalled_out = False  # True if a stall ended by STALL_LIMIT_S instead of the test

    def shut(self) -> None:
        self.open.clear()

    def wait_begun(self, version: int, timeout: float = 60) -> bool:
        """Until the store of `version` has begun (the publisher thread is inside it)."""
        with self._cond:
            return self._cond.wait_for(lambda: version in self.begun, timeout)

    def store(self, sealed: bytes) -> bool:
        version = pointer_version(sealed)
        with self._cond:
            self.begun.append(version)
            self._cond.notify_all()
        if not self.open.wait(STALL_LIMIT_S):
            self.stalled_out = True
        self.dht.values[swarm.pointer_key(RUN, COORD.peer_id)] = sealed
        self.done.append(version)
        return True

    def refresh(self, sealed: bytes) -> bool:
        return self.store(swarm.reseal_pointer(COORD, sealed))


class DhtValues:
    """The DHT as a volunteer sees it: `get(key)`."""

    def __init__(self):
        self.peer_id = "volunteer"
        self.values: dict[str, bytes] = {}

    def get(self, key: str):
        return self.values.get(key)


class PublisherFetcher:
    """Manifests and payloads from the coordinator's Publisher (what AdapterServer serves)."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher

    def manifest(self, version, verify, *, peers=True):
        raw = self.publisher.get(version).manifest_bytes
        return raw, verify(raw)

    def payload(self, manifest, manifest_bytes):
        return b"".join(self.publisher.get(manifest.version).chunks)


class RecordingAuditor:
    """Stands in for Auditor.remember_published: which versions volunteers may be audited on."""

    def __init__(self):
        self.versions: list[int] = []

    def remember_published(self, version, specs, blobs, learner_steps):
        self.versions.append(version)


def pointer_version(sealed: bytes) -> int:
    opened = envelope.open_envelope(sealed, max_bytes=4096, expected_kind="adapter_pointer",
                                    expected_audience=envelope.BROADCAST, window_s=None)
    return messages.decode(opened.payload, messages.AdapterPointer, max_bytes=4096).version


@pytest.fixture(scope="module")
def tiny_path():
    return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))


def groups_for(learner: Learner) -> list[TrainGroup]:
    tok = learner.tokenizer
    out = []
    for i in range(2):
        prompt = tok(f"rep:{'ab'[i]}=")["input_ids"]
        comps = [tok("a" * (1 + j))["input_ids"] for j in range(3)]
        out.append(TrainGroup(prompt_ids=prompt, completions=comps, sampling_logprobs=[[-1.5] * len(c) for c in comps],
                              rewards=[0.0, 0.5, 1.0], version=learner.version))
    return out


class Hub:
    """The coordinator's publish path, as service.py wires it: export on the learner thread, then the
    worker calls before_visible (audit copy, then lineage.json) before anything is visible."""

    def __init__(self, tiny_path, run_dir, keyframe_every: int = 10):
        self.learner = Learner(tiny_path, LORA, lr=1e-2, loss=LossConfig(), max_staleness=None)
        self.run_dir = run_dir
        self.auditor = RecordingAuditor()
        self.dht = DhtValues()
        self.pointer = StallingPointer(self.dht)
        self.publisher = Publisher(COORD, run_id=RUN, base_model="tiny", base_revision="r", lora=LORA,
                                   keyframe_every=keyframe_every, chunk_bytes=4096)
        self.events: list[dict] = []
        self.exports: dict[int, dict[str, bytes]] = {}
        self.worker = PublishWorker(self.publisher, self.pointer, before_visible=self.before_visible,
                                    on_published=self.events.append, refresh_s=3600).start()

    def before_visible(self, export) -> None:
        self.auditor.remember_published(export.version, export.specs, export.blobs, export.learner_steps)
        record_published(self.run_dir, export.version)

    def publish(self) -> None:
        export = export_version(self.learner, "bf16")
        self.exports[export.version] = export.blobs
        self.worker.submit(export)

    def step_and_publish(self) -> float:
        """One iteration of the learner loop; returns its wall seconds."""
        t0 = time.perf_counter()
        self.learner.step(groups_for(self.learner))
        self.learner.version += 1
        self.publish()
        return time.perf_counter() - t0


def volunteer(hub: Hub) -> AdapterSync:
    sync = AdapterSync(hub.dht, coordinator_peer_id=COORD.peer_id, coordinator_key=COORD.public_key, run_id=RUN)
    sync.fetcher = PublisherFetcher(hub.publisher)
    return sync


def test_a_stalled_dht_store_does_not_delay_learner_steps(tiny_path, tmp_path):
    hub = Hub(tiny_path, tmp_path)
    vol = volunteer(hub)
    hub.publish()  # v0, stored at once
    assert hub.worker.wait_published(0, 60) and hub.worker.wait_idle(60)
    assert vol.refresh().version == 0

    # Unstalled cadence, for the record: each publish completes before the next step (waited for: under load a
    # step can come first, and then newest wins and v1 is superseded, CI 2026-12-02 r4: done == [0, 2]).
    free = []
    for _ in range(2):
        free.append(hub.step_and_publish())
        assert hub.worker.wait_idle(60)
    assert hub.pointer.done == [0, 1, 2]

    hub.pointer.shut()  # the DHT stops answering
    stalled_at = hub.learner.version + 1
    hub.learner.step(groups_for(hub.learner))
    hub.learner.version += 1
    hub.publish()
    assert hub.pointer.wait_begun(stalled_at)  # the publisher thread is inside the stalled store
    k = 6
    stalled = [hub.step_and_publish() for _ in range(k)]
    # Every step ran while the store was still stuck: the learner never waited for it.
    assert not hub.pointer.stalled_out and hub.pointer.done[-1] == stalled_at - 1, (free, stalled)
    assert hub.learner.steps == 3 + k
    stats = hub.worker.stats()
    newest = hub.learner.version
    assert stats["in_flight"] == stalled_at and stats["queue_depth"] == 1
    assert stats["superseded"] == k - 1  # newest wins: one waits, the rest never reach the encoder
    # Nothing of the waiting or superseded versions is visible anywhere yet.
    assert hub.worker.published_version == stalled_at
    assert last_published(tmp_path) == stalled_at and hub.auditor.versions == [0, 1, 2, stalled_at]
    for v in range(stalled_at + 1, newest + 1):
        assert not hub.worker.is_published(v) and hub.publisher.get(v) is None
    vol.refresh()
    assert vol.current.version == stalled_at - 1  # the volunteer keeps the last stored version

    hub.pointer.open.set()  # the DHT answers again
    assert hub.worker.wait_published(newest, 60) and hub.worker.wait_idle(60)
    assert hub.pointer.done[-2:] == [stalled_at, newest]
    assert last_published(tmp_path) == newest and hub.auditor.versions[-1] == newest
    for v in range(stalled_at + 1, newest):  # superseded: never claimable, never servable
        assert not hub.worker.is_published(v) and hub.publisher.get(v) is None
    last = hub.events[-1]
    assert last["version"] == newest and last["codec"] == codec.DELTA_CODEC
    assert last["parent_version"] == stalled_at  # the delta is against the last *published* version
    assert last["superseded_total"] == k - 1 and last["queue_depth"] == 0 and last["latency_s"] >= last["store_s"]
    # The volunteer converges on the newest version, bit for bit.
    got = vol.refresh()
    assert got.version == newest and got.tensors == hub.exports[newest]
    hub.worker.close()


def test_keyframes_stay_in_reach_when_versions_are_skipped(tiny_path, tmp_path):
    hub = Hub(tiny_path, tmp_path, keyframe_every=3)
    hub.publish()
    assert hub.worker.wait_idle(60)
    hub.pointer.shut()
    hub.step_and_publish()  # v1: stalls in the store
    assert hub.pointer.wait_begun(1)
    for _ in range(4):  # v2..v5: v2, v3 (a multiple of 3), v4 superseded; v5 waits
        hub.step_and_publish()
    hub.pointer.open.set()
    assert hub.worker.wait_published(5, 60) and hub.worker.wait_idle(60)
    assert [(e["version"], e["parent_version"]) for e in hub.events] == [(0, None), (1, 0), (5, None)]
    got = volunteer(hub).refresh()
    assert got.version == 5 and got.tensors == hub.exports[5]
    hub.worker.close()


def test_close_abandons_the_waiting_version_and_does_not_hang_on_a_stalled_store(tiny_path, tmp_path):
    hub = Hub(tiny_path, tmp_path)
    hub.publish()
    assert hub.worker.wait_idle(60)
    hub.pointer.shut()
    hub.step_and_publish()
    assert hub.pointer.wait_begun(1)
    hub.step_and_publish()  # waits behind the stalled store
    assert not hub.worker.close(timeout=0.2)  # in flight: bounded wait, then the caller moves on
    assert hub.worker.stats()["abandoned"] == 1 and last_published(tmp_path) == 1
    with pytest.raises(RuntimeError):
        hub.publish()
    hub.pointer.open.set()
    assert hub.worker.close(timeout=60) and hub.worker.published_version == 1


class BrokenLineage(Hub):
    """before_visible fails for one version (lineage.json not writable)."""

    fail = 1

    def before_visible(self, export) -> None:
        if export.version == self.fail:
            raise OSError("disk full")
        super().before_visible(export)


def test_a_version_whose_lineage_write_fails_is_never_published(tiny_path, tmp_path):
    hub = BrokenLineage(tiny_path, tmp_path)
    hub.worker.out = lambda *a: None
    hub.publish()
    hub.step_and_publish()
    assert hub.worker.wait_idle(60)
    assert not hub.worker.wait_published(1, 1) and hub.worker.stats()["errors"] == 1
    hub.step_and_publish()
    assert hub.worker.wait_published(2, 60) and hub.worker.wait_idle(60)
    assert not hub.worker.is_published(1) and hub.worker.is_published(2) and hub.worker.is_published(0)
    assert [e["version"] for e in hub.events] == [0, 2] and hub.events[-1]["parent_version"] == 0
    hub.worker.close()


def sealed_batch(board, tokenizer, version: int) -> bytes:
    return rollouts.sealed_batch(board, tokenizer, ALICE, audience=COORD.public_key, sampling=SAMPLING, run_id=RUN,
                                 version=version)


def test_ingest_refuses_batches_claiming_a_superseded_version(tiny_path, tmp_path):
    hub = Hub(tiny_path, tmp_path)
    hub.publish()
    assert hub.worker.wait_idle(60)
    hub.pointer.shut()
    hub.step_and_publish()  # v1 stalls in the store
    assert hub.pointer.wait_begun(1)
    hub.step_and_publish()  # v2: superseded by v3
    hub.step_and_publish()
    hub.pointer.open.set()
    assert hub.worker.wait_published(3, 60) and hub.worker.wait_idle(60)
    board = TaskBoard(tasks.get_task("repeat", 0), lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=COORD.public_key, run_id=RUN, board=board, tokenizer=hub.learner.tokenizer,
                    vocab_size=hub.learner.vocab_size, current_version=lambda: hub.learner.version,
                    is_published=hub.worker.is_published, max_batch_bytes=1 << 20, window_s=300, sampling=SAMPLING)
    tok = hub.learner.tokenizer
    assert ingest.handle(sealed_batch(board, tok, 2)).code == "FUTURE_VERSION"  # never published
    assert ingest.handle(sealed_batch(board, tok, 4)).code == "FUTURE_VERSION"  # not yet published
    for v in (1, 3):
        ack = ingest.handle(sealed_batch(board, tok, v))
        assert ack.accepted and ack.code is None, ack
    hub.worker.close()


def test_the_final_pointer_follows_the_last_version_and_volunteers_see_the_end(tiny_path, tmp_path):
    hub = Hub(tiny_path, tmp_path)
    vol = volunteer(hub)
    hub.publish()
    hub.step_and_publish()  # v1 may still be in flight when the run ends: it is stored first
    assert hub.worker.finish(timeout=60)
    got = vol.refresh()
    assert got is not None and got.version == 1 and vol.finished  # fetched v1, and the run ended there
    assert pointer_version(hub.worker.final_pointer) == 1
    hub.worker._refresh()  # later refreshes re-seal the final pointer, never the last unfinished one
    assert vol.refresh() is None and vol.finished
    hub.worker.close()


class GatedLineage(Hub):
    """before_visible holds v0 until the test opens the gate: the run ends while its first version is still
    on its way to the Publisher (the CI failure of 2026-12-02: finish() found no published version and gave up)."""

    def __init__(self, *a, **kw):
        self.entered = threading.Event()
        self.gate = threading.Event()
        super().__init__(*a, **kw)

    def before_visible(self, export) -> None:
        self.entered.set()
        assert self.gate.wait(60)
        super().before_visible(export)


def test_a_run_that_ends_before_its_first_version_is_published_still_ends_with_a_final_pointer(tiny_path, tmp_path):
    hub = GatedLineage(tiny_path, tmp_path)
    vol = volunteer(hub)
    hub.publish()
    assert hub.entered.wait(60)  # v0 is in flight, the Publisher has nothing yet
    result: list[bool] = []
    finisher = threading.Thread(target=lambda: result.append(hub.worker.finish(timeout=60)))
    finisher.start()
    deadline = time.monotonic() + 60
    while not hub.worker._finishing and time.monotonic() < deadline:  # finish() has begun
        time.sleep(0.01)
    hub.gate.set()
    finisher.join(60)
    assert result == [True]
    assert pointer_version(hub.worker.final_pointer) == 0
    got = vol.refresh()
    assert got is not None and got.version == 0 and vol.finished
    hub.worker.close()
