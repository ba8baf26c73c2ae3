"""Polite mode (`join --only-when-idle`, BOINC-style): generate only while the machine is otherwise idle.

`IdleWatch.busy()` returns why the volunteer should pause now, or None. What it looks at (Linux; each
detector that cannot see anything on this machine says so once and stays silent):

  GPU users    other processes holding the GPU: NVML (pynvml) when importable, else `nvidia-smi
               --query-compute-apps=pid`; processes of our own tree (the vLLM engine) do not count.
               No NVIDIA driver: not detectable, so...
  CPU users    ...on a machine without one the GPU check becomes a CPU one: other processes' share of
               all CPU time since the last look (/proc/stat minus our process tree's /proc/<pid>/stat)
               above `cpu_busy_fraction`.
  the user     input in the last `user_idle_s` seconds: the newest access time of the terminals
               (/dev/pts/*, /dev/tty[1-63] — what `w` shows as IDLE) and a change in the keyboard and
               mouse interrupt counters (/proc/interrupts: i8042, keyboard, mouse, hid).
  snooze       `asyncrl-client pause [--for 2h]` writes <data-dir>/pause.until; `resume` removes it.
               This one works without --only-when-idle (the user asked).

The hub (client/worker.py) asks before each lease and, with --only-when-idle, between the prompts of
a lease (it then generates one prompt at a time); when busy it uploads the groups it finished,
*returns* the rest of its leases to the coordinator (a LeaseRequest with `release`, so they go to
someone else at once instead of expiring: coordinator/leasing/taskboard.py `release`), and looks again every
PAUSE_POLL_S until the machine is free.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

PAUSE_NAME = "pause.until"
INPUT_IRQ = re.compile(r"i8042|keyboard|kbd|mouse|hid", re.IGNORECASE)


def our_pids(proc: Path, root: int) -> set[int]:
    """`root` and its descendants, from /proc/<pid>/stat parent links."""
    parents: dict[int, int] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


class GpuUsers:
    """Foreign processes on the GPU (None = cannot tell on this machine)."""

    def __init__(self, *, proc: Path = Path("/proc"), nvidia_smi: str | None = None):
        self.proc = proc
        self.smi = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:
            pass

    @property
    def available(self) -> bool:
        return self._nvml is not None or bool(self.smi)

    def pids(self) -> set[int] | None:
        if self._nvml is not None:
            nv, found = self._nvml, set()
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                for getter in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
                    found |= {p.pid for p in getter(handle)}
            return found
        if self.smi:
            try:
                out = subprocess.run([self.smi, "--query-compute-apps=pid", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return None
            return {int(x) for x in re.findall(r"\d+", out)}
        return None

    def foreign(self, me: int) -> set[int] | None:
        pids = self.pids()
        return None if pids is None else pids - our_pids(self.proc, me)


class CpuUsers:
    """Other processes' share of all CPU time since the previous call (/proc)."""

    def __init__(self, *, proc: Path = Path("/proc")):
        self.proc = proc
        self._last: tuple[int, int] | None = None

    def _cpu_times(self) -> tuple[int, int]:
        """(busy, total) clock ticks of all CPUs since boot (user nice system idle iowait irq softirq steal)."""
        fields = [int(x) for x in (self.proc / "stat").read_text().splitlines()[0].split()[1:9]]
        total = sum(fields)
        return total - fields[3] - fields[4], total

    def _ours(self, me: int) -> int:
        used = 0
        for pid in our_pids(self.proc, me):
            try:
                fields = (self.proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
                used += int(fields[11]) + int(fields[12])  # utime + stime
            except (OSError, ValueError, IndexError):
                continue
        return used

    def others_fraction(self, me: int) -> float | None:
        try:
            (busy, total), ours = self._cpu_times(), self._ours(me)
        except (OSError, ValueError, IndexError):
            return None
        last, self._last = self._last, (busy - ours, total)
        if last is None or total <= last[1]:
            return None
        return max(0.0, (busy - ours - last[0]) / (total - last[1]))


class UserActivity:
    """Seconds since the user last typed or moved the mouse, as far as /dev and /proc tell."""

    def __init__(self, *, dev: Path = Path("/dev"), proc: Path = Path("/proc"), clock=time.time):
        self.dev, self.proc, self._clock = dev, proc, clock
        self._irq: int | None = None
        self._irq_changed_at = 0.0

    def _input_interrupts(self) -> int | None:
        """Sum of the per-CPU counters of keyboard/mouse interrupt lines (None: no such line)."""
        try:
            lines = (self.proc / "interrupts").read_text().splitlines()
        except OSError:
            return None
        if not lines:
            return None
        cpus = len(lines[0].split())
        total, seen = 0, False
        for line in lines[1:]:
            if INPUT_IRQ.search(line):
                counts = line.split()[1:1 + cpus]
                try:
                    total += sum(int(x) for x in counts)
                    seen = True
                except ValueError:
                    continue
        return total if seen else None

    def idle_s(self) -> float | None:
        now = self._clock()
        newest = None
        for pattern in ("pts/[0-9]*", "tty[1-9]", "tty[1-6][0-9]"):
            for path in glob.glob(str(self.dev / pattern)):
                try:
                    atime = os.stat(path).st_atime
                except OSError:
                    continue
                newest = atime if newest is None else max(newest, atime)
        irq = self._input_interrupts()
        if irq is not None:
            if self._irq is not None and irq != self._irq:
                self._irq_changed_at = now
            self._irq = irq
            if self._irq_changed_at:
                newest = self._irq_changed_at if newest is None else max(newest, self._irq_changed_at)
        return None if newest is None else max(0.0, now - newest)


def snoozed_until(data_dir: Path) -> float:
    """The time `asyncrl-client pause` asked to pause until (0 = not snoozed)."""
    try:
        return float((Path(data_dir) / PAUSE_NAME).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


class IdleWatch:
    def __init__(self, data_dir: Path, *, only_when_idle: bool, user_idle_s: float = 300.0,
                 cpu_busy_fraction: float = 0.5, gpu: GpuUsers | None = None, cpu: CpuUsers | None = None,
                 user: UserActivity | None = None, clock=time.time, me: int | None = None):
        self.data_dir = Path(data_dir)
        self.only_when_idle = only_when_idle
        self.user_idle_s, self.cpu_busy_fraction = user_idle_s, cpu_busy_fraction
        self._clock = clock
        self.me = os.getpid() if me is None else me
        self.gpu = gpu if gpu is not None else (GpuUsers() if only_when_idle else None)
        self.cpu = cpu if cpu is not None else (CpuUsers() if only_when_idle else None)
        self.user = user if user is not None else (UserActivity() if only_when_idle else None)

    def detectors(self) -> list[str]:
        """What this machine lets us watch (shown at start, so a user knows what pauses us)."""
        if not self.only_when_idle:
            return ["snooze"]
        seen = ["snooze", "GPU processes" if self.gpu.available else "CPU use of other processes"]
        if self.user.idle_s() is not None:
            seen.append("user input (terminals, keyboard/mouse interrupts)")
        return seen

    def busy(self) -> str | None:
        until = snoozed_until(self.data_dir)
        if until > self._clock():
            return f"paused by `asyncrl-client pause` until {time.strftime('%H:%M:%S', time.localtime(until))}"
        if not self.only_when_idle:
            return None
        if self.gpu.available:
            foreign = self.gpu.foreign(self.me)
            if foreign:
                return f"other processes use the GPU (pid {', '.join(map(str, sorted(foreign)[:4]))})"
        else:
            share = self.cpu.others_fraction(self.me)
            if share is not None and share > self.cpu_busy_fraction:
                return f"other processes use {share:.0%} of the CPU"
        idle = self.user.idle_s()
        if idle is not None and idle < self.user_idle_s:
            return f"the user was active {idle:.0f} s ago"
        return None
