"""Checkpoints in-process: a restored learner continues bit for bit, retention and atomicity, and the
exactly-once books across a simulated crash (real keys, real ingest, journal and task board)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from asyncrl import tasks
from asyncrl.coordinator import checkpoint
from asyncrl.coordinator.ingest.ingest import Ingest
from asyncrl.coordinator.ingest.journal import IngestJournal
from asyncrl.coordinator.learner.ddp_check import synthetic_groups
from asyncrl.coordinator.learner.learner import Learner
from asyncrl.coordinator.learner.loss import LossConfig
from asyncrl.coordinator.leasing.taskboard import TaskBoard
from asyncrl.models import tinymodel
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity
from asyncrl.tasks.sources import open_source

COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=8)
LORA = messages.LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
IDENTITY = {"run_id": "r", "base_model": "tiny", "base_revision": "x", "lora": {"r": 4}}


@pytest.fixture(scope="module")
def model_path():
    torch.set_num_threads(1)
    return str(tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir()))


class Run:
    """One coordinator 'process': learner, board, journal, ingest and checkpointing over run_dir."""

    def __init__(self, run_dir, model_path, every=0, resume=True, **learner_kwargs):
        self.learner = Learner(model_path, LORA, lr=1e-2, loss=LossConfig(), max_staleness=None, seed=0,
                               **learner_kwargs)
        self.board = TaskBoard(open_source("repeat", seed=0), lease_timeout_s=60, max_leases_per_client=16)
        self.journal = IngestJournal(run_dir / "journal")
        self.ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=self.board,
                             tokenizer=self.learner.tokenizer, vocab_size=self.learner.vocab_size,
                             current_version=lambda: self.learner.version, max_batch_bytes=1 << 20, window_s=300,
                             journal=self.journal, sampling=SAMPLING)
        self.ckpt = checkpoint.Checkpointing(run_dir, every=every, keep=2, gate=checkpoint.Gate(), learner=self.learner,
                                             board=self.board, ingest=self.ingest, journal=self.journal,
                                             identity=IDENTITY, resume=resume, out=lambda s: None)
        self.trained: list[bytes] = []

    def sealed_batch(self) -> bytes:
        lease = self.board.lease(ALICE.public_key, 1)[0]
        ids = self.learner.tokenizer(lease.prompt.text)["input_ids"]
        comps = []
        for letters in ("aaaa", "abab", "cd"):
            toks = self.learner.tokenizer(letters)["input_ids"]
            comps.append(messages.Completion(np.asarray(toks, "<i4").tobytes(), np.full(len(toks), -1.5, "<f4").tobytes(),
                                             tasks.score(lease.prompt.reward, letters, lease.prompt.answer), "length"))
        group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id, np.asarray(ids, "<i4").tobytes(),
                                      tuple(comps))
        batch = messages.RolloutBatch(run_id="r", adapter_version=self.learner.version, client_name="alice",
                                      sampling=SAMPLING, groups=(group,), generated_at=0.0)
        return envelope.seal(ALICE, "rollout_batch", messages.encode(batch), audience=COORD.public_key)

    def train_queued(self) -> None:
        """What the coordinator's loop does: take, step, count, log the batch ids."""
        items = self.ingest.take(1, max_wait_s=0.1, min_groups=1, stop=threading.Event())
        while items:
            result = self.learner.step([g for it in items for g in it.groups])
            self.board.mark_trained(result.groups_used)
            self.trained += [it.batch_id for it in items]
            if self.ingest.queued_groups == 0:
                break
            items = self.ingest.take(1, max_wait_s=0.1, min_groups=1, stop=threading.Event())


def test_a_restored_learner_continues_bit_for_bit(tmp_path, model_path):
    a = Run(tmp_path, model_path)
    for step in range(2):
        a.learner.step(synthetic_groups(step, 3))
    a.ckpt.save()
    after_save = torch.rand(3)
    a.learner.step(synthetic_groups(2, 3))

    b = Run(tmp_path, model_path)
    b.ckpt.resume()
    assert torch.equal(torch.rand(3), after_save)  # RNG restored
    assert b.learner.steps == 2
    b.learner.step(synthetic_groups(2, 3))
    pa, pb = a.learner.lora_parameters(), b.learner.lora_parameters()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_lr_schedule_survives_resume(tmp_path, model_path):
    """--resume restores the scheduler: warmup + cosine continue where they were, not from step 0."""
    sched = dict(lr_scheduler="cosine", warmup_steps=2, total_steps=8)
    a = Run(tmp_path, model_path, **sched)
    lrs = []
    for step in range(3):
        lrs.append(a.learner.step(synthetic_groups(step, 2)).metrics["lr"])
    assert lrs[0] == 0.0 and 0.0 < lrs[1] < lrs[2] == pytest.approx(1e-2)  # linear warmup to the peak
    a.ckpt.save()
    a_next = [a.learner.step(synthetic_groups(3 + k, 2)).metrics["lr"] for k in range(2)]
    assert a_next[0] > a_next[1] > 0.0  # cosine decay

    b = Run(tmp_path, model_path, **sched)
    b.ckpt.resume()
    assert b.learner.scheduler.state_dict()["last_epoch"] == 3
    b_next = [b.learner.step(synthetic_groups(3 + k, 2)).metrics["lr"] for k in range(2)]
    assert b_next == a_next
    fresh = Run(tmp_path / "other", model_path, **sched)  # without the checkpoint it would start over
    assert fresh.learner.step(synthetic_groups(3, 2)).metrics["lr"] == 0.0


def test_retention_atomicity_and_identity_checks(tmp_path, model_path):
    a = Run(tmp_path, model_path)
    for step in range(3):
        a.learner.step(synthetic_groups(step, 2))
        a.ckpt.save()
    root = tmp_path / "checkpoints"
    (root / ".tmp-00000099-1-1").mkdir()  # a crash mid-write leaves only a temp dir
    names = sorted(p.name for p in root.glob("step-*"))
    assert len(names) == 2 and names[-1].startswith("step-00000003")
    store = checkpoint.Checkpointer(root)
    assert not (root / ".tmp-00000099-1-1").exists()
    assert store.latest().meta["learner_steps"] == 3
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.check_identity(store.latest(), {**IDENTITY, "base_model": "other"})
    with pytest.raises(checkpoint.CheckpointError):
        Run(tmp_path / "empty", model_path).ckpt.resume()
    fresh = Run(tmp_path, model_path, resume=False)  # a new lineage in the same run_dir: the old one is kept aside
    assert fresh.ckpt.store.latest() is None
    assert len(list(tmp_path.glob("replaced-*/checkpoints/step-*"))) == 2


def test_exactly_once_across_a_crash(tmp_path, model_path):
    a = Run(tmp_path, model_path)
    x = a.sealed_batch()
    ack = a.ingest.handle(x)
    assert ack.accepted and ack.code is None
    again = a.ingest.handle(x)  # the ack was lost: same bytes again
    assert again.accepted and again.code == "DUPLICATE_BATCH"
    a.train_queued()
    assert a.trained == [ack.batch_id]  # trained once

    y = a.sealed_batch()
    assert a.ingest.handle(y).accepted  # accepted, still queued at the checkpoint
    a.ckpt.save()
    z = a.sealed_batch()
    assert a.ingest.handle(z).accepted  # acked after the checkpoint: only the journal has it
    w = a.sealed_batch()  # leased after the checkpoint, never delivered before the crash
    a.train_queued()  # trained before the crash, but after the checkpoint: rolled back by the resume
    published = a.learner.version = 7
    checkpoint.record_published(tmp_path, published)
    del a  # crash

    b = Run(tmp_path, model_path)
    info = b.ckpt.resume()
    assert info["replayed_batches"] == 2 and info["settled_after_checkpoint"] == 1
    assert b.learner.version == published + 1  # the lineage continues above anything published
    codes = [b.ingest.handle(s) for s in (x, y, z)]
    assert all(c.accepted and c.code == "DUPLICATE_BATCH" for c in codes)
    assert b.ingest.handle(w).code == "UNKNOWN_LEASE"
    b.train_queued()
    ids = {envelope.open_envelope(s, max_bytes=1 << 20, expected_kind="rollout_batch",
                                  expected_audience=None).payload_id for s in (x, y, z)}
    trained = [ack.batch_id] + b.trained  # the checkpoint's history, then this run
    assert sorted(trained) == sorted(ids)  # every accepted batch exactly once
    assert b.board.balanced(queued_groups=b.ingest.queued_groups)
    b.ckpt.save()
    b.ckpt.save()
    assert len(b.journal) == 0  # covered by both retained checkpoints: the journal is empty again


def test_journal_keeps_arrays_as_bytes_and_reads_older_list_entries(tmp_path):
    """Ingest's array groups come back from the journal equal (ids int32, logprobs float32), written as raw
    bytes; an entry from before (lists inside the groups, no `arrays`) still reads."""
    import msgspec

    from asyncrl.coordinator.ingest.ingest import AcceptedBatch
    from asyncrl.coordinator.ingest.journal import JournalEntry
    from asyncrl.coordinator.learner.learner import TrainGroup, rows_of

    rng = np.random.default_rng(0)
    groups = [TrainGroup([1, 2, 3], [rng.integers(0, 151_933, 510 + i, dtype=np.int64).astype("<i4") for i in range(3)],
                         [(-rng.exponential(1.0, 510 + i)).astype("<f4") for i in range(3)], [0.0, 1.0, 0.5], version=2,
                         truncated=[True, False, False]) for _ in range(2)]
    journal = IngestJournal(tmp_path / "journal")
    journal.put(AcceptedBatch(b"a" * 32, "alice", groups, 0.5, 2, 1.0, prompt_ids=("p1", "p2")))
    old = JournalEntry(b"b" * 32, "bob", 2, 0.5, 2.0, ["p3"], [TrainGroup([1], [[5, 6]], [[-0.5, -1.5]], [1.0], 2)])
    (tmp_path / "journal" / f"{(b'b' * 32).hex()}.entry").write_bytes(msgspec.msgpack.encode(old))
    new_entry, old_entry = journal.entries()
    assert [(r.ids.tolist(), r.sampling_logprobs.tolist()) for r in rows_of(new_entry.groups)] == \
        [(r.ids.tolist(), r.sampling_logprobs.tolist()) for r in rows_of(groups)]
    assert [g.truncated for g in new_entry.groups] == [g.truncated for g in groups]
    assert old_entry.groups[0].completions == [[5, 6]] and old_entry.groups[0].sampling_logprobs == [[-0.5, -1.5]]
    raw = sum(c.nbytes + lp.nbytes for g in groups for c, lp in zip(g.completions, g.sampling_logprobs))
    size = (tmp_path / "journal" / f"{(b'a' * 32).hex()}.entry").stat().st_size
    assert size < raw + 1024  # the bytes themselves (msgpack lists of these numbers: ~1.75x raw)
