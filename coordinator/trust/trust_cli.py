"""Command-line flags for the trust settings (access modes, limits, strikes, generation audit).

Each flag's dest is a CoordinatorConfig field name, so coordinator/config_file.py's precedence rules
apply unchanged (defaults < --config TOML < flags). Owned by the trust work (issue 7); the fields and
their meaning live in coordinator/config.py, the mechanisms in coordinator/trust/access.py and audit.py.
"""

from __future__ import annotations

import argparse


def add_trust_arguments(parser: argparse.ArgumentParser, d) -> None:
    g = parser.add_argument_group("trust: volunteers are untrusted (docs/SECURITY.md)")
    g.add_argument("--access-mode", dest="access_mode", choices=["open", "allowlist"],
                   help=f"who may contribute (default {d.access_mode})")
    g.add_argument("--allowlist", dest="allowlist_path", metavar="FILE",
                   help="volunteer keys (hex, peer id or fingerprint per line), re-read on change")
    g.add_argument("--banlist", dest="banlist_path", metavar="FILE", help="banned keys, same format, re-read on change")
    g.add_argument("--identity-rate", dest="identity_rate_per_s", type=float,
                   help=f"requests/s per volunteer key (default {d.identity_rate_per_s}; <= 0 unlimited)")
    g.add_argument("--identity-burst", dest="identity_burst", type=int, help=f"default {d.identity_burst}")
    g.add_argument("--peer-rate", dest="peer_rate_per_s", type=float,
                   help=f"requests/s per transport peer (default {d.peer_rate_per_s})")
    g.add_argument("--peer-burst", dest="peer_burst", type=int, help=f"default {d.peer_burst}")
    g.add_argument("--new-identity-rate", dest="new_identity_rate_per_s", type=float,
                   help=f"first contacts of unseen keys per second, all together (default {d.new_identity_rate_per_s})")
    g.add_argument("--new-identity-burst", dest="new_identity_burst", type=int, help=f"default {d.new_identity_burst}")
    g.add_argument("--batches-per-hour", dest="batches_per_hour", type=int,
                   help="quota of accepted batches per key per hour (0 = none)")
    g.add_argument("--max-strikes", dest="max_strikes", type=int, help=f"strikes before a key is banned "
                                                                        f"(default {d.max_strikes})")
    g.add_argument("--peer-max-strikes", dest="peer_max_strikes", type=int,
                   help=f"unattributable offences before a peer is banned (default {d.peer_max_strikes})")
    g.add_argument("--no-audit", dest="audit", action="store_const", const=False,
                   help="switch the generation (logprob) audit off")
    g.add_argument("--audit-floor", dest="audit_floor", type=float,
                   help=f"lowest audit probability for trusted keys (default {d.audit_floor}; 1 = audit all)")
    g.add_argument("--audit-tolerance", dest="audit_tolerance", type=float,
                   help=f"nats/token a completion's logprobs may differ by when its engine is not said; the "
                        f"floor of every learned engine tolerance (default {d.audit_tolerance})")
    g.add_argument("--no-audit-calibration", dest="audit_calibrate", action="store_const", const=False,
                   help="do not learn engine classes' tolerances (every class gets --audit-tolerance)")
    g.add_argument("--audit-learn-batches", dest="audit_learn_batches", type=int,
                   help=f"audited batches an engine class's tolerance is learned from (default {d.audit_learn_batches})")
    g.add_argument("--audit-learn-tolerance", dest="audit_learn_tolerance", type=float,
                   help=f"tolerance while an fp32 engine class learns, no strikes; the ceiling of what it learns "
                        f"(default {d.audit_learn_tolerance})")
    g.add_argument("--audit-learn-tolerance-half", dest="audit_learn_tolerance_half", type=float,
                   help=f"the same for bf16/fp16 engine classes, whose rounded logits are noisier "
                        f"(default {d.audit_learn_tolerance_half})")
    g.add_argument("--audit-queue", dest="audit_queue", type=int,
                   help=f"accepted batches waiting for their audit at most; then submits are RATE_LIMITED "
                        f"(default {d.audit_queue})")
    g.add_argument("--audit-device", dest="audit_device",
                   help="device of the shadow-model audits (default: the learner's; e.g. cuda:1 holds a full copy)")
    g.add_argument("--audit-margin", dest="audit_margin", type=float,
                   help=f"learned tolerance = margin x the 0.95 quantile of honest batches (default {d.audit_margin})")
    g.add_argument("--audit-quarantine-passes", dest="audit_quarantine_passes", type=int,
                   help=f"audits in a row a key must pass to leave quarantine (default {d.audit_quarantine_passes})")
    g.add_argument("--audit-quarantine-strikes", dest="audit_quarantine_strikes", type=int,
                   help=f"failed audits in one quarantine that earn a strike (default {d.audit_quarantine_strikes})")
    n = parser.add_argument_group("inbound budgets (docs/transport.md)")
    n.add_argument("--timestamp-window-s", dest="timestamp_window_s", type=float,
                   help=f"signed requests older/newer than this are refused (default {d.timestamp_window_s})")
    n.add_argument("--inbound-bytes", dest="inbound_bytes", type=int,
                   help=f"request bytes received or handled at once, all peers (default {d.inbound_bytes})")
    n.add_argument("--max-streams-per-peer", dest="max_streams_per_peer", type=int,
                   help=f"open inbound streams per peer id (default {d.max_streams_per_peer})")
    n.add_argument("--min-upload-bps", dest="min_upload_bps", type=int,
                   help=f"slowest accepted upload; slower streams are cut (default {d.min_upload_bps})")
    n.add_argument("--handler-threads", dest="handler_threads", type=int, help=f"default {d.handler_threads}")
    n.add_argument("--handler-queue", dest="handler_queue", type=int,
                   help=f"requests waiting for a handler thread before RATE_LIMITED (default {d.handler_queue})")
    n.add_argument("--serve-new-bps", dest="serve_new_bps", type=int,
                   help=f"adapter bytes/s to peers without accepted batches, together (default {d.serve_new_bps})")
    n.add_argument("--serve-new-peer-bps", dest="serve_new_peer_bps", type=int,
                   help=f"...and to each of them (default {d.serve_new_peer_bps})")
