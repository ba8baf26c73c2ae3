"""Command-line flags for the trust settings (access modes, limits, strikes, generation audit).

Each flag's dest is a CoordinatorConfig field name, so coordinator/config_file.py's precedence rules
apply unchanged (defaults < --config TOML < flags). Owned by the trust work (issue 7); the fields and
their meaning live in coordinator/config.py, the mechanisms in coordinator/access.py and audit.py.
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
                   help=f"nats/token a completion's logprobs may differ by (default {d.audit_tolerance})")
