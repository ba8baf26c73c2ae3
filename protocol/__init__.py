"""asyncrl.protocol — the wire contract shared by coordinator and clients.

Pure by design: imports numpy, msgspec and cryptography only — never torch, hivemind, vLLM or
transformers (tests/protocol/test_purity.py proves it in a clean interpreter), so everything here is
fast to test and fuzz. Nothing is re-exported; import from the submodule that owns the name.

Who owns what:
  errors.py    RejectCode (stable machine-readable reject reasons) and ProtocolError.
  limits.py    named size/count/time caps (MAX_ENVELOPE_BYTES, TIMESTAMP_WINDOW_S, ...).
  identity.py  Ed25519 Identity (key files, libp2p identity file), peer id <-> public key, fingerprints,
               verify_signature.
  messages.py  typed msgspec messages (AdapterManifest, AdapterPointer, LeaseRequest/LeaseGrant,
               TaskLease, RolloutBatch, Ack, ...), encode/decode with size caps, semantic validators.
  envelope.py  seal/open_envelope (sign exact bytes, verify before decoding) and ReplayGuard.
  codec.py     adapter tensor codec (keyframes and deltas, chunking).
  swarm.py     DHT swarm records: pointer/presence keys, who may write them, which pointer is newer.
  receipts.py  coordinator-signed contribution receipts: seal, verify offline, the export file.
  atomic.py    durable file writes (temp + fsync + rename) and fsynced append-only record logs.

Exception tree (flat on purpose: branch on `.code`)::

    Exception
     └── ProtocolError(code: RejectCode, detail: str)   str() == "CODE: detail"

For any input bytes, decoders and `open_envelope` raise ProtocolError and nothing else; programming
mistakes by the caller (wrong-length audience passed to `seal`, ...) raise ValueError/TypeError.
"""
