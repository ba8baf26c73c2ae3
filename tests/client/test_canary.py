"""The adapter-identity canary (models/canary.py): a volunteer whose engine silently ignores the adapter never
generates with that version and says so (to the user and, as a health report, to the coordinator, which
records it and never strikes); one whose adapter loads right passes on every version.

Real engines on the tiny model: the learner side is a PEFT model whose LoRA-B the test sets (version 0:
zeros, as a fresh run's), exported and canaried exactly as `coordinator/publisher.py export_version` does."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from asyncrl.client.engine import TransformersEngine
from asyncrl.coordinator.ingest.ingest_books import ClientStats
from asyncrl.coordinator.leasing.leasing import LeaseDesk, LeasePolicy
from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy
from asyncrl.models import tinymodel
from asyncrl.models.canary import make_canary
from asyncrl.models.lora import export_lora, load_base_model, with_lora
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity
from asyncrl.tasks.sources import open_source

from tests.client.test_base_pin import manifest_for
from tests.client.test_pipeline import LeaseDesk as VolunteerDesk
from tests.client.test_pipeline import pipelined_volunteer

LORA = messages.LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj"))


class LoraDroppingEngine(TransformersEngine):
    """An engine that says it loaded each version and silently keeps serving the base model (the failure
    verl users met: frozen base weights synced, zero LoRA tensors)."""

    def load_adapter(self, version, specs, blobs):
        self.version = version


@dataclass
class Version:  # what AdapterSync hands the volunteer
    version: int
    manifest: messages.AdapterManifest
    tensors: dict


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tinymodel.write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", instruct=True))


@pytest.fixture(scope="module")
def versions(tiny):
    """Versions 0..2 of a run: v0 with LoRA-B zero, then B set to growing random values (a trained adapter)."""
    from asyncrl.models import pinning

    base, tokenizer = load_base_model(tiny)
    model = with_lora(base, LORA).eval()
    pin = pinning.pin_directory(tiny, name=tiny)
    gen = torch.Generator().manual_seed(0)
    out = []
    for v in range(3):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5 * v)
        specs, blobs = export_lora(model, "fp32")
        out.append(Version(v, manifest_for(pin, version=v, lora=LORA, tensors=tuple(specs),
                                           raw_bytes=sum(s.nbytes for s in specs),
                                           canary=make_canary(model, tokenizer)), blobs))
    return out


class StopAfterPolls:
    """AdapterSync stand-in: `current` loaded, nothing newer; the engine loop polls once per round, and the
    volunteer is stopped at the `rounds`-th poll."""

    finished = False

    def __init__(self, vol, current, rounds: int):
        self.vol, self.current, self.rounds, self.polls = vol, current, rounds, 0

    def poll(self):
        self.polls += 1
        if self.polls >= self.rounds:
            self.vol.stop.set()
        return None


def volunteer_with(engine, tmp_path):
    desk = VolunteerDesk(per_lease=1)
    vol = pipelined_volunteer(tmp_path, desk)
    vol.engine = engine
    return vol, desk


def test_an_engine_that_drops_the_lora_never_generates_with_that_version_and_says_so(tiny, versions, tmp_path):
    vol, desk = volunteer_with(LoraDroppingEngine(tiny, LORA), tmp_path)
    said = []
    vol.display.event = lambda kind, message, **kw: said.append((kind, message))
    vol._load(versions[0])  # zero LoRA-B: nothing to tell apart yet, so nothing is refused
    assert vol.canary_refused is None and vol.serving_version == 0 and vol.status.canary["passed"]
    vol._load(versions[1])
    assert vol.canary_refused == 1 and vol.serving_version == 0, "v1 is refused: the engine serves the base model"
    assert vol.status.canary_failures == 1 and vol.status.canary["base_diff"] < vol.status.canary["diff"]
    failed = [r for r in desk.canaries if not r.passed]
    assert [r.version for r in failed] == [1], "the coordinator is told at once"
    warning = [m for k, m in said if k == "warning" and "canary" in m]
    assert len(warning) == 1 and "did not reach the engine" in warning[0] and "--engine transformers" in warning[0]

    vol.sync = StopAfterPolls(vol, versions[1], rounds=3)
    vol.run()
    assert desk.granted == [] and desk.delivered == set(), "no lease asked for and no batch sent for a refused version"
    assert vol.status.state == "refused"


def test_an_engine_that_loads_the_adapter_passes_on_every_version(tiny, versions, tmp_path):
    vol, desk = volunteer_with(TransformersEngine(tiny, LORA), tmp_path)
    for v in versions:
        vol._load(v)
        assert vol.canary_refused is None and vol.serving_version == v.version
        assert vol.status.canary["passed"] and vol.status.canary["diff"] < 1e-3, vol.status.canary
    assert vol.status.canary_failures == 0
    told_apart = [make_apart(v) for v in versions]
    assert told_apart == [False, True, True], "the test's v1 and v2 differ from the base model on the probe"

    vol.sync = StopAfterPolls(vol, versions[2], rounds=2)
    vol.run()  # the passed canary goes with the first lease request
    assert [r.version for r in desk.canaries] == [2] and desk.canaries[0].passed and desk.delivered


def make_apart(v: Version) -> bool:
    import numpy as np

    c = v.manifest.canary
    return bool(np.abs(np.frombuffer(c.logprobs, "<f4") - np.frombuffer(c.base_logprobs, "<f4")).mean() > 0.05)


def test_a_failed_canary_is_recorded_and_shown_never_struck():
    tokenizer = tinymodel.build_tokenizer()
    coordinator, volunteer = Identity.generate(), Identity.generate()
    access = AccessControl(AccessPolicy())
    stats = ClientStats(name="bob", fingerprint="f")

    class Ingest:  # what the desk asks of ingest, plus the canary note
        sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=8)

        def queued(self):
            return 0

        def note_client(self, signer, name=""):
            pass

        def note_canary(self, signer, report):
            stats.note_canary(report)

    from asyncrl.coordinator.leasing.taskboard import TaskBoard

    board = TaskBoard(open_source("repeat", seed=1), lease_timeout_s=60, max_leases_per_client=8)
    desk = LeaseDesk(LeasePolicy(run_id="r", group_size=4, prompts_per_lease=2, max_inflight_groups=8, window_s=300),
                     audience=coordinator.public_key, board=board, ingest=Ingest(), access=access,
                     tokenizer=tokenizer, current_version=lambda: 3)
    for _ in range(3):  # as many as would ban a cheater (max_strikes)
        req = messages.LeaseRequest(run_id="r", max_prompts=0, adapter_version=2, client_name="bob",
                                    canary=messages.CanaryReport(version=3, passed=False, diff=0.9, base_diff=0.01))
        desk.handle(envelope.seal(volunteer, "lease_request", messages.encode(req), audience=coordinator.public_key),
                    peer="p")
    assert access.strikes(volunteer.public_key) == 0 and not access.is_banned(volunteer.public_key)
    assert stats.canary.startswith("v3 FAILED") and stats.canary_failures == 3
    stats.note_canary(messages.CanaryReport(version=4, passed=True, diff=0.001, base_diff=0.8))
    assert stats.canary == "v4 ok"


def test_the_canary_is_scored_on_the_published_weights_and_leaves_the_learner_exact(tiny):
    """Published in bf16 (the default --publish-dtype), the canary holds what an engine serving those bf16
    LoRA tensors scores, not what the learner's fp32 LoRA scores: the gap between the two grows with the
    adapter (a CI swarm's v1551: 0.082 per token, past the fp32 tolerance, and both honest volunteers
    refused it and every later lease). The learner's own LoRA values come back bit for bit."""
    from asyncrl.models.canary import canary_tokens, judge, published_lora

    base, tokenizer = load_base_model(tiny)
    model = with_lora(base, LORA)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 4.0)
    exact = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = TransformersEngine(tiny, LORA)
    specs, blobs = export_lora(model, "bf16")
    engine.load_adapter(1, specs, blobs)

    canary = make_canary(model, tokenizer, "bf16")
    scored = engine.score(*canary_tokens(canary))
    assert judge(scored, canary, dtype="fp32").diff <= 1e-5, "the canary is the published weights' own score"
    learner_fp32 = make_canary(model, tokenizer)  # what was published before: the fp32 LoRA's score
    assert judge(scored, learner_fp32, dtype="fp32").diff > 1e-3, "this adapter's bf16 rounding shows on the probe"
    assert model.training, "make_canary leaves the learner in the mode it found"
    assert all(torch.equal(p, exact[n]) for n, p in model.named_parameters()), "the learner's LoRA is restored"

    with pytest.raises(RuntimeError):  # restored on the way out of an error too
        with published_lora(model, "fp16"):
            raise RuntimeError("a forward pass that failed")
    assert all(torch.equal(p, exact[n]) for n, p in model.named_parameters())
