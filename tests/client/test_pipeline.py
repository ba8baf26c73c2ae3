"""The pipelined volunteer (client/pipeline.py) against an in-process coordinator desk: the next lease is in
hand before a generation ends, every lease is one engine call, and a volunteer that stops keeps no lease:
each one granted — the one generating and the one fetched ahead — is either delivered in an acked batch or
returned. Ordering comes from events the fakes set, never from sleeps."""

from __future__ import annotations

import threading

import numpy as np

from asyncrl.client.engine_api import Sample
from asyncrl.client.pacing import DutyCycle, IdleBackoff
from asyncrl.client.worker import Volunteer, VolunteerConfig
from asyncrl.protocol import envelope, messages
from asyncrl.protocol.identity import Identity

COORDINATOR = Identity.from_seed(bytes(range(32)))
SAMPLING = messages.SamplingParams(max_new_tokens=2)
WAIT_S = 60.0  # an event a test waits for; reaching it is the assertion, never a measured duration


class LeaseDesk:
    """Stands in for the SwarmNode and the coordinator's lease + submit streams: grants `per_lease` prompts
    per request, applies renewals and returns, acks every batch, and remembers who holds what."""

    def __init__(self, per_lease: int = 2):
        self.per_lease = per_lease
        self.granted: list[tuple[str, ...]] = []  # lease ids per grant, in order
        self.released: set[str] = set()
        self.delivered: set[str] = set()  # lease ids in acked batches
        self.second_grant = threading.Event()
        self.canaries: list[messages.CanaryReport] = []  # canary reports carried by lease requests
        self._lock = threading.Lock()

    def outstanding(self) -> set[str]:
        return {i for g in self.granted for i in g} - self.released - self.delivered

    def call(self, peer, name, sealed, *, max_response_bytes, timeout=30.0):
        if name.endswith("submit"):
            opened = envelope.open_envelope(sealed, max_bytes=1 << 30, expected_kind="rollout_batch",
                                            expected_audience=COORDINATOR.public_key)
            batch = messages.decode(opened.payload, messages.RolloutBatch, max_bytes=1 << 30)
            with self._lock:
                self.delivered.update(g.lease_id for g in batch.groups)
            return messages.encode(messages.Ack(batch_id=opened.payload_id, accepted=True))
        opened = envelope.open_envelope(sealed, max_bytes=1 << 20, expected_kind="lease_request",
                                        expected_audience=COORDINATOR.public_key)
        req = messages.decode(opened.payload, messages.LeaseRequest, max_bytes=1 << 20)
        with self._lock:
            self.released.update(req.release)
            if req.canary is not None:
                self.canaries.append(req.canary)
            renewed = tuple(messages.LeaseRenewal(i, 60.0) for i in req.renew)
            leases = ()
            if req.max_prompts > 0:
                first = sum(len(g) for g in self.granted)
                leases = tuple(lease(first + i) for i in range(min(req.max_prompts, self.per_lease)))
                self.granted.append(tuple(l.lease_id for l in leases))
                if len(self.granted) == 2:
                    self.second_grant.set()
        return messages.encode(messages.LeaseGrant(run_id="r", leases=leases, current_version=0, renewed=renewed))


def lease(i: int) -> messages.TaskLease:
    return messages.TaskLease(lease_id=f"l{i}", prompt_id=f"p{i}", prompt="x", answer="", reward="exact",
                              prompt_token_ids=np.asarray([1], dtype="<i4").tobytes(), group_size=2,
                              sampling=SAMPLING, expires_at=0.0)


class Detokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class WaitingEngine:
    """Generates zeros; its first call waits until the desk has granted the leases fetched ahead, then asks
    the volunteer to stop (Ctrl-C arriving mid-generation)."""

    def __init__(self, desk: LeaseDesk, stop: threading.Event):
        self.desk, self.stop_volunteer = desk, stop
        self.tokenizer = Detokenizer()
        self.calls: list[int] = []  # prompts per generate call
        self.ahead_in_time: list[bool] = []  # was the next lease granted before this generation ended?

    def generate(self, prompts, group_size, sampling):
        self.calls.append(len(prompts))
        self.ahead_in_time.append(self.desk.second_grant.wait(WAIT_S))
        self.stop_volunteer.set()
        return [[Sample([0, 0], [-0.5, -0.5], "length") for _ in range(group_size)] for _ in prompts]


class Adapter:
    version = 0


class StillSync:
    """AdapterSync stand-in: version 0 loaded, nothing newer, the run not finished."""

    current = Adapter()
    finished = False

    def poll(self):
        return None


def pipelined_volunteer(tmp_path, desk: LeaseDesk, **cfg) -> Volunteer:
    vol = Volunteer(VolunteerConfig(address=f"/ip4/127.0.0.1/tcp/4001/p2p/{COORDINATOR.peer_id}", data_dir=tmp_path,
                                    name="v", display="quiet", prompts_per_batch=desk.per_lease,
                                    fixed_lease_size=True, **cfg))
    vol.node, vol.run_id, vol.serving_version = desk, "r", 0
    vol.sync, vol.hold = StillSync(), None
    vol.pacer, vol.idle = DutyCycle(1.0), IdleBackoff(0.01)
    vol.engine = WaitingEngine(desk, vol.stop)
    return vol


def test_the_next_lease_is_in_hand_before_the_generation_ends(tmp_path):
    desk = LeaseDesk(per_lease=3)
    vol = pipelined_volunteer(tmp_path, desk)
    vol.run()
    assert vol.engine.ahead_in_time == [True], "the second grant arrived while the engine generated"
    assert vol.engine.calls == [3], "one engine call per lease, every prompt in it"


def test_a_stopped_volunteer_returns_the_lease_fetched_ahead_and_delivers_the_one_it_generated(tmp_path):
    desk = LeaseDesk(per_lease=2)
    vol = pipelined_volunteer(tmp_path, desk)
    status = vol.run()
    first, ahead = desk.granted
    assert desk.delivered == set(first), "the generated work is scored, spooled and acked before run() returns"
    assert desk.released == set(ahead), "the leases fetched ahead go back to the coordinator"
    assert desk.outstanding() == set() and len(vol.outbox) == 0
    assert (status.batches_acked, status.leases_returned) == (1, len(ahead))


def test_the_serial_loop_fetches_nothing_ahead(tmp_path):
    desk = LeaseDesk(per_lease=2)
    vol = pipelined_volunteer(tmp_path, desk, pipeline=False)
    vol.engine.desk.second_grant.set()  # nothing to wait for: the serial loop never asks while generating
    vol.run()
    assert len(desk.granted) == 1 and desk.delivered == set(desk.granted[0]) and desk.outstanding() == set()


class UnreachableOnce(LeaseDesk):
    """The coordinator's first submit breaks (the stream reset), every later one is acked."""

    def __init__(self):
        super().__init__()
        self.submits = 0

    def call(self, peer, name, sealed, *, max_response_bytes, timeout=30.0):
        if name.endswith("submit"):
            self.submits += 1
            if self.submits == 1:
                from asyncrl.swarm.transport import TransportError

                raise TransportError("Connection reset by peer")
        return super().call(peer, name, sealed, max_response_bytes=max_response_bytes, timeout=timeout)


def spooled_batch(i: int) -> messages.RolloutBatch:
    done = messages.Completion(token_ids=np.zeros(2, "<i4").tobytes(), logprobs=np.zeros(2, "<f4").tobytes(),
                               reward=0.0, finish_reason="length")
    group = messages.RolloutGroup(lease_id=f"old{i}", prompt_id=f"p-old{i}",
                                  prompt_token_ids=np.ones(1, "<i4").tobytes(), completions=(done, done))
    return messages.RolloutBatch(run_id="r", adapter_version=0, client_name="v", sampling=SAMPLING, groups=(group,),
                                 generated_at=0.0)


def test_a_restarted_volunteer_whose_first_upload_broke_delivers_its_spooled_batches(tmp_path):
    """--max-batches 2 with two batches spooled by an earlier run: they are the work in flight, so the loop
    waits for their acks — and must keep uploading them while it waits, also when the start-up flush broke."""
    desk = UnreachableOnce()
    vol = pipelined_volunteer(tmp_path, desk, max_batches=2, poll_s=0.05)
    for i in range(2):
        vol.outbox.put(messages.encode(spooled_batch(i)))
    runner = threading.Thread(target=vol.run, daemon=True)
    runner.start()
    runner.join(WAIT_S)
    stuck = runner.is_alive()
    vol.stop.set()  # a hang guard: lets a stuck loop end before the assertion reports it
    runner.join(WAIT_S)
    assert not stuck, f"run() never finished: {desk.submits} submits, {len(vol.outbox)} batches still spooled"
    assert desk.delivered == {"old0", "old1"} and len(vol.outbox) == 0 and vol.status.batches_acked == 2
    assert desk.granted == [], "the spooled batches were the two --max-batches allows: no lease asked"
