"""What the operator sees and runs.

  telemetry.py       `Telemetry`: the one object the hub wires in, over the next four
  metrics.py         `RunStats` and the Prometheus collector
  dashboard.py       the status page, /api/status, /metrics, /plot.png; dashboard_page.py is its HTML
  plots.py           reward.png
  reporters.py       optional TensorBoard / W&B / trackio sinks
  reward_log.py      per-reward statistics and the completions log, as TRL logs them
  capacity.py        `CapacityMeter`: does the swarm keep the learner busy
  admin.py           the subcommands besides `run`: status, keys, finish, example-config (+ export, eval)
  export.py          a checkpoint as a PEFT / merged model directory
  evaluate.py        greedy accuracy of a run's adapter (or its base) on the task's evaluation split

Imports only the run's shared modules (coordinator/config.py, config_file.py, checkpoint.py, run_end.py);
only the hub (coordinator/cli.py, service.py) imports it. Nothing here references the `Coordinator`.
"""
