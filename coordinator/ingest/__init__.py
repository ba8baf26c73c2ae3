"""Ingest: a volunteer's batch from bytes on the wire to groups in the learner's queue.

  ingest.py        `Ingest`: size, signature, freshness, nonce, schema, leases, rewards, dedupe, queue
  ingest_books.py  bounded bookkeeping: per-key stats, seen ids, reward traces
  journal.py       `IngestJournal`: every accepted batch on disk before its ack leaves
  receipts.py      `ReceiptDesk`: a signed contribution receipt for every accepted batch
  episodes.py      multi-turn episodes verified by replaying their environment

Imports learner/ (`TrainGroup`), trust/ (strike rules, the audit worker) and leasing/ (whose leases a
batch answers); never operator/.
"""
