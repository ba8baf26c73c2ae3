"""Run plots: reward and staleness over optimizer steps, read from `<run_dir>/metrics.jsonl`.

Owned here, used by both `asyncrl demo` (after the swarm stops) and `asyncrl-coordinator run` (at the
end of a run and on demand: SIGUSR1 or the dashboard's /plot.png). The plot is written to a temp
name and renamed over `<run_dir>/reward.png`, so a reader never sees half a PNG. matplotlib is not
thread-safe, hence one module-level lock around every figure.

    python -c "from pathlib import Path; from asyncrl.coordinator.operator.plots import plot_run; print(plot_run(Path('runs/demo')))"
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

from asyncrl.protocol.atomic import write_atomic
from asyncrl.runlog import read_events

PLOT_NAME = "reward.png"
SMOOTH_WINDOW = 10
_figure_lock = threading.Lock()


def moving_average(values: list[float], window: int = SMOOTH_WINDOW) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_run(run: Path) -> Path | None:
    """reward and mean staleness per optimizer step -> run/reward.png (None when no step was logged)."""
    run = Path(run)
    steps = read_events(run, "step")
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e["step"] for e in steps]
    rewards = [e["reward_mean"] for e in steps]
    staleness = [sum(e["staleness"]) / max(1, len(e["staleness"])) for e in steps]
    out = run / PLOT_NAME
    png = io.BytesIO()
    with _figure_lock:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
        try:
            ax1.plot(xs, rewards, alpha=0.3, label="batch mean")
            ax1.plot(xs, moving_average(rewards), label=f"moving average ({SMOOTH_WINDOW})")
            ax1.set_ylabel("reward")
            ax1.legend(loc="lower right")
            ax2.plot(xs, staleness, color="tab:orange")
            ax2.set_ylabel("mean staleness (versions)")
            ax2.set_xlabel("optimizer step")
            fig.suptitle("asyncrl run: reward and staleness")
            fig.tight_layout()
            fig.savefig(png, dpi=100, format="png")
        finally:
            plt.close(fig)
    return write_atomic(out, png.getvalue())


class PlotOnDemand:
    """Writes the plot on a background thread when asked (signal handlers and HTTP handlers must not
    block on matplotlib). Requests that arrive while a plot is being drawn collapse into one more."""

    def __init__(self, run: Path):
        self.run = Path(run)
        self._wanted = threading.Event()
        self._closed = threading.Event()
        self.written = 0
        self._thread = threading.Thread(target=self._loop, name="plot-on-demand", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def _loop(self) -> None:
        while True:
            self._wanted.wait()
            if self._closed.is_set():
                return
            self._wanted.clear()
            try:
                if plot_run(self.run) is not None:
                    self.written += 1
            except Exception as exc:  # a plot must never take the coordinator down
                print(f"warning: plot failed: {exc.__class__.__name__}: {exc}", flush=True)

    def close(self) -> None:
        self._closed.set()
        self._wanted.set()
        self._thread.join(timeout=30)
