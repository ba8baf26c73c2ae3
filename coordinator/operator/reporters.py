"""Optional experiment trackers: TensorBoard, Weights & Biases, trackio (`report_to` / `--report-to`).

None of them is a dependency. Each is imported only when asked for; asking for one that is not
installed is a ConfigError at start-up (before the model loads) that names the package to install.
A tracker that fails mid-run is switched off with one warning: metrics.jsonl stays the record of
truth, and a tracker must never stop training.

Each `step` event becomes one logged row at that optimizer step (reward, loss, staleness, clip
fraction, step time, grad norm, token entropy, learning rate, step tokens/s, adapter version and the
latest publish size).

    asyncrl-coordinator run --config coordinator.toml --report-to tensorboard,wandb
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..config import ConfigError

# report_to name -> (module that must import, pip package to suggest)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "trackio": ("trackio", "trackio")}
PROJECT = "asyncrl"


def check_available(names, find_spec=importlib.util.find_spec) -> None:
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"unknown report_to target {name!r}; choose from {sorted(TRACKERS)}")
        module, package = TRACKERS[name]
        if find_spec(module) is None:
            raise ConfigError(f"report_to {name!r} needs the {package!r} package, which is not installed "
                              f"(pip install {package})")


def _row(fields: dict, last_publish_bytes: int | None) -> dict[str, float]:
    stale = fields.get("staleness") or []
    row = {"reward_mean": fields.get("reward_mean"), "loss": fields.get("loss"),
           "clip_fraction": fields.get("clip_fraction"), "step_seconds": fields.get("seconds"),
           "groups": fields.get("groups"), "dropped_stale": fields.get("dropped_stale"),
           "staleness_mean": sum(stale) / len(stale) if stale else 0.0, "adapter_version": fields.get("version"),
           "grad_norm": fields.get("grad_norm"), "entropy": fields.get("entropy_mean"), "lr": fields.get("lr"),
           "tokens_per_s": fields.get("tokens_per_s"),
           "publish_bytes": last_publish_bytes}
    row.update({k: v for k, v in fields.items() if k.startswith("rewards/")})  # TRL's rewards/<name>/mean|std
    return {k: float(v) for k, v in row.items() if v is not None}


class Reporters:
    def __init__(self, names, *, run_dir: Path, run_id: str, config: dict, out=print):
        check_available(names)
        self.out = out
        self.sinks: dict[str, object] = {}
        self._last_publish_bytes: int | None = None
        for name in names:
            self.sinks[name] = getattr(self, f"_open_{name}")(Path(run_dir), run_id, config)

    def _open_tensorboard(self, run_dir: Path, run_id: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        return lambda row, step: [writer.add_scalar(k, v, step) for k, v in row.items()], writer.close

    def _open_wandb(self, run_dir: Path, run_id: str, config: dict):
        import wandb

        run = wandb.init(project=PROJECT, name=run_id, dir=str(run_dir), config=config)
        return lambda row, step: run.log(row, step=step), run.finish

    def _open_trackio(self, run_dir: Path, run_id: str, config: dict):
        import trackio

        trackio.init(project=PROJECT, name=run_id, config=config)
        return lambda row, step: trackio.log(row, step=step), trackio.finish

    def observe(self, event: str, fields: dict) -> None:
        if event == "publish":
            self._last_publish_bytes = fields.get("compressed_bytes")
        if event != "step" or not self.sinks:
            return
        row = _row(fields, self._last_publish_bytes)
        for name, (log, _) in list(self.sinks.items()):
            try:
                log(row, fields["step"])
            except Exception as exc:
                self.out(f"warning: report_to {name} failed and is switched off: {exc.__class__.__name__}: {exc}")
                del self.sinks[name]

    def close(self) -> None:
        for name, (_, close) in list(self.sinks.items()):
            try:
                close()
            except Exception as exc:
                self.out(f"warning: closing report_to {name}: {exc.__class__.__name__}: {exc}")
        self.sinks.clear()
