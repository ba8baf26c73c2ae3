"""The coordinator: one process that trains the adapter and runs the swarm's side of the protocol.

    asyncrl-coordinator run --model tiny --max-steps 150 --run-dir runs/demo      (coordinator/cli.py)

The folder is the architecture. The hub wires everything; each sub-package is one box of the diagram
(README "Map"), and tests/test_layering.py holds who may import whom:

  cli.py, service.py   the hub: the command line and `Coordinator`, which builds the components below
                       and runs the learner loop; nothing else imports them
  config.py, config_file.py, checkpoint.py, publisher.py, run_end.py, base_model.py
                       what the whole run shares: its one config object, checkpoints and --resume, the
                       adapter publisher, the end-of-run signal, the pinned base model
  learner/             GRPO on LoRA: the loss, the off-policy corrections, DDP/FSDP; imports nothing else here
  leasing/             who gets which prompts: handshake, task board, lease desk, sync rounds, quorum,
                       start-up preflight; imports nothing else here
  trust/               who may talk and whether they lied: access control, the generation audit, trust
                       state on disk; imports learner/ only (the audit recomputes log-probs)
  ingest/              a volunteer's batch from bytes to the learner's queue: verify, dedupe, journal,
                       receipts, episode replay; imports learner/, trust/ and leasing/
  operator/            what the operator sees and runs: telemetry, metrics, dashboard, plots, trackers,
                       the admin subcommands, export, evaluate; imports only the shared modules above,
                       and only the hub imports it

Sub-packages import each other relatively (`from ..learner.learner import TrainGroup`); other subsystems
absolutely (`from asyncrl.protocol import envelope`).
"""
