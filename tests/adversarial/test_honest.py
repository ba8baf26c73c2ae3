"""Honest volunteers are never punished for our problems, and their batches are charged to nobody else:
an honest volunteer whose engine runs in bf16 (what GPU engines do) over many batches, copies of her batches
sent from other peer ids, a volunteer whose outbox holds batches too large for the coordinator, and a
current-version cheater against a DDP learner (which takes no train-time audit hook)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from asyncrl.protocol import messages, receipts
from asyncrl.protocol.identity import Identity

from tests.adversarial.swarm import RUN_ID, batch_id_of, completion, read_json, wait_for

pytestmark = pytest.mark.integration

BF16_BATCHES = 12


@pytest.fixture(scope="module")
def bea(package_mallory):
    """An honest volunteer run from the test process: her own key, her own peer id, an engine in bf16 (her
    node lives as long as this module's tests)."""
    from asyncrl.client.engine import TransformersEngine
    from asyncrl.models import tinymodel

    ident = Identity.generate()
    node = package_mallory.own_node(ident, track=False)
    path = tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir())
    engine = TransformersEngine(str(path), package_mallory.sync.current.manifest.lora, seed=21, dtype=torch.bfloat16)
    yield ident, node, engine
    node.shutdown()


def bea_batch(mallory, bea, n=2) -> tuple[bytes, bytes]:
    ident, node, engine = bea
    adapter = mallory.follow()
    leases = mallory.lease(ident, n, node=node)
    groups = mallory.generate(leases, adapter, engine=engine)
    batch = mallory.batch(groups, adapter.version, client_name="bea", engine_dtype="bf16")
    payload = messages.encode(batch)
    return payload, mallory.seal(ident, payload)


def test_an_honest_bf16_volunteer_is_never_struck(mallory, swarm, bea, attack):
    rec = attack("honest bf16 volunteer", f"not an attack: an honest volunteer whose engine runs the model in bf16 "
                 f"(as GPU engines do) sends {BF16_BATCHES} batches, audited as any new key is (always at first)",
                 note="tried = her batches; rejected must stay 0 (her engine class learns its own tolerance)")
    ident = bea[0]
    codes, broke = [], 0
    for _ in range(BF16_BATCHES):
        payload, _ = bea_batch(mallory, bea)
        code, lost_streams = mallory.deliver(ident, payload, node=bea[1])  # re-sends as her outbox would
        broke += lost_streams
        codes.append(code)
        rec.saw(code, rejected=code != "ACCEPTED")
    rec.honest_extra = sum(c != "ACCEPTED" for c in codes)
    if broke:
        rec.note += f"; {broke} upload streams broke without an answer and were re-sent, as a client does"
    assert codes == ["ACCEPTED"] * BF16_BATCHES, codes
    access = swarm.trust()["access"]
    assert ident.fingerprint not in access["banned"]
    assert access["identities"].get(ident.fingerprint, {}).get("strikes", 0) == 0
    audit = swarm.trust()["audit"]
    engine = audit["policy"]["engines"]["unknown/bf16"]  # her batches say bf16, no engine kind (an older client)
    assert engine["samples"] >= 1 and engine["tolerance"] > audit["tolerance"]  # learned from bf16 engines' own batches


def oversized_payloads(lease_prefix: str) -> tuple[bytes, bytes]:
    """Two batches too large for the coordinator's 8 MiB cap: 12 groups (splittable) and one huge group."""
    def group(i, tokens):
        comp = completion(np.arange(tokens) % 50 + 1, np.full(tokens, -1.0), 0.0)
        return messages.RolloutGroup(f"{lease_prefix}-{i}", f"p-{i}", np.arange(8, dtype="<i4").tobytes(),
                                     (comp,) * 64)
    sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=8)
    many = messages.RolloutBatch(run_id=RUN_ID, adapter_version=0, client_name="carol", sampling=sampling,
                                 groups=tuple(group(i, 1500) for i in range(12)), generated_at=0.0)
    one = messages.RolloutBatch(run_id=RUN_ID, adapter_version=0, client_name="carol", sampling=sampling,
                                groups=(group(99, 20000),), generated_at=0.0)
    return messages.encode(many), messages.encode(one)


def test_a_batch_too_large_for_the_coordinator_never_jams_the_outbox(swarm, attack):
    rec = attack("oversized-batch outbox jam", "a volunteer restarts with two spooled batches over the coordinator's "
                 "8 MiB cap (12 groups; one group of 64 x 20000 tokens)",
                 note="the first is split by groups and sent, the second quarantined; her new work goes through")
    from asyncrl.client.outbox import Outbox

    carol = swarm.root / "carol"
    box = Outbox(carol / "outbox")
    many, one = oversized_payloads("carol-old")
    assert len(many) > 8 * 1024 * 1024 and len(one) > 8 * 1024 * 1024
    many_id, one_id = box.put(many), box.put(one)
    proc = swarm.procs.start("carol", ["-m", "asyncrl.client.cli", "join", swarm.join, "--name", "carol", "--data-dir",
                                       str(carol), "--threads", "1", "--max-batches", "2", "--quiet"])
    assert proc.wait(300) == 0, proc.log_path.read_text()[-3000:]  # it used to crash at every restart
    st = read_json(carol / "status.json")
    pending = set(Outbox(carol / "outbox").pending())
    assert st["batches_acked"] >= 2 and many_id not in pending and one_id not in pending
    assert st["batches_split"] >= 1 and st["batches_quarantined"] == 1
    assert [n["batch_id"] for n in Outbox(carol / "outbox").quarantined()] == [one_id.hex()]  # kept, not deleted
    rec.saw("SPLIT")
    rec.saw("QUARANTINED")


def test_a_current_version_cheater_against_a_ddp_learner(swarm, attack, tmp_path):
    rec = attack("DDP current-version cheater", "made-up logprobs for the current adapter version, against a 2-rank "
                 "DDP learner (torchrun, gloo) whose ranks take no train-time audit hook",
                 note="audited on the shadow model by the audit worker instead (tests/adversarial/ddp_cheater.py)")
    out = tmp_path / "ddp_cheater.json"
    proc = swarm.procs.start("ddp-cheater", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                             "-m", "tests.adversarial.ddp_cheater", "--out", str(out)])
    assert proc.wait(300) == 0, proc.log_path.read_text()[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and not result["hook_taken"] and not result["reuse_learner_pass"]
    for code in result["cheater"]:
        rec.saw(code)
    assert result["cheater"] == ["LOGPROB_MISMATCH"] * 2 and result["honest"] == ["ACCEPTED"] * 2
    assert result["trained_from"] == [result["honest_fp"]] and result["trained_groups"] == 4


COPIES = 4  # per sending peer id, before and after bea's own delivery


def test_copies_of_a_volunteers_batch_from_other_peers_are_charged_to_those_peers(mallory, swarm, bea, attack):
    rec = attack("copies from other peers", f"mallory sends copies of bea's sealed batch from 2 fresh peer ids of "
                 f"hers, {COPIES} each before bea delivers it and {COPIES} each after; and copies of a new key's "
                 "first batch before its signer ever delivered one",
                 note="refused and booked on mallory's peer ids; bea's own delivery accepted, nothing on her books; "
                      "the new key's own delivery is acked, as a duplicate, with its receipt")
    ident, node, engine = bea
    senders = [mallory.new_node(), mallory.new_node()]
    _, first = bea_batch(mallory, bea)
    assert mallory.final_code(first, node=node) == "ACCEPTED"  # she delivers from her own peer id, as volunteers do
    _, sealed = bea_batch(mallory, bea)

    def copies():
        for sender in senders:
            for _ in range(COPIES):
                code, _ = mallory.submit(sealed, node=sender)
                rec.saw(code)
                assert code == "NOT_ALLOWED", code

    copies()
    assert mallory.final_code(sealed, node=node) == "ACCEPTED"  # the very bytes mallory sent; no verdict but hers
    copies()  # after it: still the senders' problem, not a duplicate on her books

    def booked():
        trust = swarm.trust()
        peers = trust["access"]["peers"]
        refused = [peers.get(s.peer_id, {}).get("foreign_refused", 0) for s in senders]
        return trust if refused == [2 * COPIES] * 2 else None
    trust = wait_for(booked, 60, "trust.json to book the refused copies on mallory's peer ids")
    assert trust["clients"][ident.fingerprint]["rejected"] == {}, trust["clients"][ident.fingerprint]
    assert trust["access"]["identities"].get(ident.fingerprint, {}).get("rate_limited", 0) == 0

    # A key that has not delivered anything from its own peer yet: a copy is charged to its sender's bucket and
    # trained as the signer's work (the bytes are hers); her own delivery then gets the ack and her receipt.
    dee = Identity.generate()
    dee_node = mallory.own_node(dee)
    _, dee_sealed = bea_batch(mallory, (dee, dee_node, engine))
    codes = [mallory.submit(dee_sealed, node=s)[0] for s in senders]
    assert codes == ["ACCEPTED", "DUPLICATE_BATCH"], codes
    code, ack = mallory.submit(dee_sealed, node=dee_node)
    assert code == "DUPLICATE_BATCH" and ack.accepted, (code, ack)
    receipt = receipts.open_receipt(ack.receipt, coordinator_key=swarm.coordinator_key, volunteer_key=dee.public_key)
    assert receipt.batch_id == ack.batch_id == batch_id_of(dee_sealed)
    rec.note += f"; new key's copies: {codes}, its own delivery: {code} (accepted=True, receipt)"
