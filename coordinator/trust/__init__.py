"""Trust: who may talk to the coordinator, and whether what they sent is what an honest engine makes.

  access.py        `AccessControl`: open or allowlist, bans, token buckets, strikes and suspicions
  audit.py         `Auditor`: the generation audit (recompute a sample's log-probs under its version)
  audit_policy.py  the audit's tolerance per engine class, learned from honest batches
  audit_worker.py  `AuditWorker`: the audits that need a pass of their own, off the ack and the learner
  trust_state.py   `TrustState`: replay nonces and seen ids on disk across restarts
  trust_cli.py     the `run` flags of all the above

Imports learner/ only (the audit scores rows with the learner's log-probs); never operator/ or ingest/.
"""
