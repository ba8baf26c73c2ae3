"""Polite mode: what pauses a volunteer (client/polite.py, on synthetic /proc and /dev trees) and how a
paused lease ends (client/rollout.py: finished groups kept; client/lease_rpc.py: the rest handed back with
LeaseRequest.release)."""

from __future__ import annotations

import os
import time

import numpy as np

from asyncrl.client import cli
from asyncrl.client.engine_api import Sample
from asyncrl.client.polite import CpuUsers, GpuUsers, IdleWatch, UserActivity, our_pids
from asyncrl.client.worker import Volunteer, VolunteerConfig
from asyncrl.protocol import messages
from asyncrl.protocol.identity import Identity


def fake_proc(root, *, stat_line: str, procs: dict[int, tuple[int, int, int]], interrupts: str = ""):
    """procs: pid -> (parent pid, utime, stime)."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(stat_line + "\n")
    (root / "interrupts").write_text(interrupts)
    for pid, (ppid, utime, stime) in procs.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 5
        (root / str(pid) / "stat").write_text(f"{pid} (python worker) " + " ".join(fields) + "\n")
    return root


def test_our_process_tree_is_not_someone_else(tmp_path):
    proc = fake_proc(tmp_path / "proc", stat_line="cpu 0 0 0 0 0 0 0 0",
                     procs={10: (1, 0, 0), 11: (10, 0, 0), 12: (11, 0, 0), 20: (1, 0, 0)})
    assert our_pids(proc, 10) == {10, 11, 12}


class SmiOutput(GpuUsers):
    """nvidia-smi's answer, scripted."""

    def __init__(self, proc, pids):
        super().__init__(proc=proc, nvidia_smi="nvidia-smi")
        self._nvml, self.listed = None, pids

    def pids(self):
        return set(self.listed)


def test_other_gpu_processes_pause_us_and_our_engine_does_not(tmp_path):
    proc = fake_proc(tmp_path / "proc", stat_line="cpu 0 0 0 0 0 0 0 0", procs={10: (1, 0, 0), 11: (10, 0, 0)})
    ours = IdleWatch(tmp_path, only_when_idle=True, gpu=SmiOutput(proc, [11]), user=UserActivity(dev=tmp_path / "no"),
                     me=10)
    assert ours.busy() is None  # only our vLLM engine child is on the GPU
    theirs = IdleWatch(tmp_path, only_when_idle=True, gpu=SmiOutput(proc, [11, 4242]),
                       user=UserActivity(dev=tmp_path / "no"), me=10)
    assert "4242" in theirs.busy()


def test_without_a_gpu_other_processes_cpu_share_pauses_us(tmp_path):
    root = tmp_path / "proc"
    fake_proc(root, stat_line="cpu 100 0 100 800 0 0 0 0", procs={10: (1, 50, 50)})
    cpu = CpuUsers(proc=root)
    assert cpu.others_fraction(10) is None  # needs two looks
    fake_proc(root, stat_line="cpu 180 0 180 840 0 0 0 0", procs={10: (1, 60, 60)})  # +200 ticks: 160 busy, 20 ours
    assert abs(cpu.others_fraction(10) - 140 / 200) < 1e-9
    watch = IdleWatch(tmp_path, only_when_idle=True, gpu=GpuUsers(proc=root, nvidia_smi=""), cpu=cpu,
                      user=UserActivity(dev=tmp_path / "no", proc=root), cpu_busy_fraction=0.5, me=10)
    fake_proc(root, stat_line="cpu 180 0 180 1040 0 0 0 0", procs={10: (1, 60, 60)})  # +200 ticks, all idle
    assert watch.busy() is None


def test_user_input_pauses_us(tmp_path):
    dev = tmp_path / "dev"
    (dev / "pts").mkdir(parents=True)
    tty = dev / "pts" / "0"
    tty.write_text("")
    now = time.time()
    os.utime(tty, (now - 1000, now - 1000))
    root = fake_proc(tmp_path / "proc", stat_line="cpu 0 0 0 0 0 0 0 0", procs={},
                     interrupts="           CPU0       CPU1\n  1:   5   7   IO-APIC   1-edge      i8042\n")
    user = UserActivity(dev=dev, proc=root, clock=lambda: now)
    assert 999 < user.idle_s() < 1001
    (root / "interrupts").write_text("           CPU0       CPU1\n  1:   9   7   IO-APIC   1-edge      i8042\n")
    assert user.idle_s() == 0.0  # a key was pressed since the last look
    watch = IdleWatch(tmp_path, only_when_idle=True, gpu=SmiOutput(root, []), user=user, user_idle_s=60, me=1)
    assert watch.busy() is not None


def test_pause_and_resume_commands_work_without_polite_mode(tmp_path, capsys):
    watch = IdleWatch(tmp_path, only_when_idle=False)
    assert watch.busy() is None
    assert cli.main(["pause", "--data-dir", str(tmp_path), "--for", "1h"]) == 0
    assert watch.busy() is not None
    assert cli.main(["resume", "--data-dir", str(tmp_path)]) == 0
    assert watch.busy() is None
    assert cli.main(["pause", "--data-dir", str(tmp_path), "--for", "soon"]) == 2


class CountingEngine:
    """Generates two zeros per sample and counts prompts per call."""

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, prompts, group_size, sampling):
        self.calls.append(len(prompts))
        return [[Sample([0, 0], [-0.5, -0.5], "length") for _ in range(group_size)] for _ in prompts]


class PauseAfter:
    """IdleWatch stand-in: busy from the n-th question on."""

    def __init__(self, n):
        self.n, self.asked = n, 0

    def busy(self):
        self.asked += 1
        return "the user came back" if self.asked >= self.n else None


SAMPLING = messages.SamplingParams(max_new_tokens=2)


def leases(n):
    return [messages.TaskLease(lease_id=f"l{i}", prompt_id=f"p{i}", prompt="x", answer="", reward="exact",
                               prompt_token_ids=np.asarray([1], dtype="<i4").tobytes(), group_size=2,
                               sampling=SAMPLING, expires_at=0.0) for i in range(n)]


def volunteer(tmp_path, **cfg) -> Volunteer:
    coordinator = Identity.from_seed(bytes(range(32)))
    vol = Volunteer(VolunteerConfig(address=f"/ip4/127.0.0.1/tcp/4001/p2p/{coordinator.peer_id}", data_dir=tmp_path,
                                    name="v", display="quiet", **cfg))
    vol.engine = CountingEngine()
    return vol


def test_a_pause_mid_lease_keeps_the_finished_groups_and_hands_back_the_rest(tmp_path):
    vol = volunteer(tmp_path / "polite", only_when_idle=True, user_idle_s=0, idle_max_cpu=1.0)
    vol.polite = PauseAfter(2)
    done, unfinished, reason = vol._generate_politely(leases(4), 2, SAMPLING)
    assert [l.lease_id for l, _ in done] == ["l0", "l1"] and [l.lease_id for l in unfinished] == ["l2", "l3"]
    assert reason and vol.engine.calls == [1, 1]  # one prompt at a time, asking in between
    whole = volunteer(tmp_path / "plain")
    done, unfinished, reason = whole._generate_politely(leases(4), 2, SAMPLING)
    assert whole.engine.calls == [4] and len(done) == 4 and not unfinished and reason is None  # one engine call


class LosesFirstAnswer:
    """A coordinator node whose first answer is lost on the way (the request may have been applied)."""

    def __init__(self):
        self.requests: list[messages.LeaseRequest] = []

    def call(self, peer, name, sealed, **kw):
        from asyncrl.protocol import envelope
        from asyncrl.swarm.transport import TransportError

        opened = envelope.open_envelope(sealed, max_bytes=1 << 20, expected_kind="lease_request",
                                        expected_audience=Identity.from_seed(bytes(range(32))).public_key)
        self.requests.append(messages.decode(opened.payload, messages.LeaseRequest, max_bytes=1 << 20))
        if len(self.requests) == 1:
            raise TransportError("IncompleteReadError: 0 bytes read")
        return messages.encode(messages.LeaseGrant(run_id="r", leases=(), current_version=0))


def test_a_release_whose_answer_is_lost_is_sent_once_more(tmp_path, monkeypatch):
    from asyncrl.client import lease_rpc

    monkeypatch.setattr(lease_rpc, "RELEASE_RETRY_S", 0.0)
    vol = volunteer(tmp_path)
    vol.node, vol.run_id, vol.serving_version = LosesFirstAnswer(), "r", 0
    vol._release(leases(3)[1:], "the user came back")
    assert [r.release for r in vol.node.requests] == [("l1", "l2")] * 2 and all(r.max_prompts == 0 for r in vol.node.requests)
    assert vol.status.leases_returned == 2
