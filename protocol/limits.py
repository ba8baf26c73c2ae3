"""Named size and time limits of the wire contract.

Each cap exists so that a receiver can refuse hostile or broken input *before* spending memory or CPU
on it: sizes are checked on the raw byte count before decoding, counts are enforced by the decoder
as it reads array headers (msgspec checks a declared length before building the elements).
Change a value here, never as a literal elsewhere; the coordinator's config may lower (not raise)
them per run.
"""

from __future__ import annotations

MiB = 1024 * 1024
KiB = 1024

# A signed envelope (header + body + payload). A full rollout batch is ~256 groups x 64 completions
# x a few hundred tokens x 8 bytes/token ≈ tens of MiB at the extreme; anything bigger is abuse.
MAX_ENVELOPE_BYTES = 32 * MiB

# An adapter manifest: tensor specs + one 32-byte hash per chunk. Even a 72B-sized LoRA manifest is
# a few hundred KiB; 1 MiB keeps it well under hivemind's 4 MiB DHT/RPC message limit.
MAX_MANIFEST_BYTES = 1 * MiB

# The pointer stored in the DHT (run, version, manifest hash). DHT values must stay tiny: hivemind
# replicates them to several peers and silently drops oversized ones.
MAX_POINTER_BYTES = 4 * KiB

# A sealed contribution receipt (protocol/receipts.py) rides on every Ack: ~400 bytes in practice.
MAX_RECEIPT_BYTES = 2 * KiB

# Adapter chunks travel over P2P streams; 1 MiB is a good unit for hashing, resuming and
# re-serving. A manifest may choose another size up to MAX_CHUNK_BYTES (the receiver's read buffer).
DEFAULT_CHUNK_BYTES = 1 * MiB
MAX_CHUNK_BYTES = 4 * MiB

# Rollout batch shape caps: a batch is a unit of idempotent ingest, not a bulk transfer, and
# GRPO group sizes beyond 64 bring nothing. They also bound the object count a decoder can create.
MAX_GROUPS_PER_BATCH = 256
MAX_REWARD_ERROR_CHARS = 500  # LeaseRequest.reward_error: what a volunteer's reward raised, for the operator
MAX_COMPLETIONS_PER_GROUP = 64
# Longest prompt or completion, in tokens (int32 ids -> at most 128 KiB per sequence field).
MAX_TOKENS_PER_SEQUENCE = 32768

# Adapter manifest shape caps: bound the object count (and the shape products a validator computes)
# of a manifest. A rank-r LoRA on an 80-layer model with 7 target modules has 1120 tensors.
MAX_TENSORS_PER_ADAPTER = 8192
MAX_TENSOR_DIMS = 8
# Stop-token set of the base model in a manifest (Qwen2.5-Instruct has 2; a handful is normal).
MAX_STOP_TOKENS = 64
MAX_CANARY_TOKENS = 128  # prompt and completion tokens each in an adapter's canary (messages.Canary)

# An envelope is accepted only if its timestamp is within ±5 minutes of the receiver's clock:
# generous for volunteers' unsynchronised clocks, short enough that the replay guard's memory of
# nonces only has to cover this window.
TIMESTAMP_WINDOW_S = 300.0

# Random nonce per envelope; 128 bits makes accidental collisions impossible in practice, so a
# repeated (signer, nonce) is a replay.
NONCE_BYTES = 16

# Rewards: a completion's claimed total (TRL-style rewards are not clamped into [0, 1], weighted sums
# neither) must be finite and within this bound — beyond it a reward is broken, not informative.
MAX_ABS_REWARD = 1e6

# Dataset columns a lease carries for TRL-style rewards (tasks/prompt.py `columns`, canonical JSON, the
# dataset's prompt included): bounded per record, checked when the task source opens.
MAX_TASK_COLUMNS_CHARS = 64 * 1024
# A whole LeaseGrant as a volunteer reads it (prompt text + token ids + columns per lease).
MAX_LEASE_GRANT_BYTES = 4 * MiB

# Free-text and identifier fields have length caps (characters), checked by the decoder like the
# array caps above, so a signed message cannot make a receiver keep (and write to disk) a 60 KB name.
MAX_NAME_CHARS = 64        # a volunteer's display name (client_name)
MAX_ID_CHARS = 128         # run ids, lease ids, codec names, revisions, finish reasons, reward names
MAX_PROMPT_ID_CHARS = 256  # prompt ids (dataset-derived)
MAX_MODEL_CHARS = 256      # base model names / paths, tensor and module names
MAX_DETAIL_CHARS = 1024    # human-readable detail of an Ack
# An adapter has at most this many chunks (64 GiB at the default 1 MiB chunk).
MAX_CHUNKS_PER_ADAPTER = 65536
