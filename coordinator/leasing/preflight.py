"""Start-up cross-checks of the config against the model and the data, before anything is leased.

Each check turns a failure that would otherwise show up hours into a run — every volunteer's batch
refused as PAYLOAD_TOO_LARGE, a lease grant too big to read, prompts the engines cannot take — into
one clear error at start (`PreflightError`, exit code 2 from the CLI):

  open_task          the task source as the config names it, opened and checked whole with the checks below
                     (the coordinator's one way to open it: coordinator/service.py and the docs' recipe tests)
  prompt_budget      the model's context minus max_new_tokens: what the task source allows a prompt
                     (tasks/sources.py `check_records`; too long -> error naming the record, or skipped)
  check_batch_fits   a full batch (prompts_per_lease groups x group_size completions at max_new_tokens,
                     the longest prompt) sealed fits max_batch_bytes
  check_grant_fits   a full lease grant (prompts_per_lease leases of the longest prompt and columns)
                     fits what a volunteer reads (limits.MAX_LEASE_GRANT_BYTES)

Sizes come from the protocol's own encoders (messages.rollout_batch_bytes_bound,
envelope.sealed_size_bound), not from a hand-kept formula.
"""

from __future__ import annotations

from asyncrl.protocol import envelope, limits, messages


class PreflightError(ValueError):
    """The config cannot work with this model or data; the message says what to change."""


def prompt_budget(model_config, max_new_tokens: int) -> int | None:
    """Most prompt tokens a record may have: the context (max_position_embeddings) minus max_new_tokens,
    and never more than the wire's sequence cap. None when the model does not say its context."""
    context = getattr(model_config, "max_position_embeddings", None)
    if not context:
        return limits.MAX_TOKENS_PER_SEQUENCE
    budget = int(context) - max_new_tokens
    if budget < 1:
        raise PreflightError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context "
                             f"of {context} tokens: lower max_new_tokens")
    return min(budget, limits.MAX_TOKENS_PER_SEQUENCE)


def open_task(cfg, tokenizer, model_config):
    """`cfg.task` opened with every task field of the config, its records checked against the model's
    context, and a full batch and a full lease grant of its largest records checked against the byte caps.
    TaskSourceError / PreflightError name what to change."""
    from asyncrl.tasks.sources import open_source

    if cfg.task.startswith("env:"):  # multi-turn episodes (envs/)
        return open_env_task(cfg, tokenizer, model_config)
    source = open_source(cfg.task, seed=cfg.seed, tokenizer=tokenizer,
                         max_prompt_tokens=prompt_budget(model_config, cfg.max_new_tokens),
                         oversized=cfg.oversized_records, **cfg.task_options())
    longest = source.report.longest_prompt_tokens if source.report else 64  # toy prompts are a few tokens
    check_batch_fits(cfg, longest)
    if source.report is not None:
        check_grant_fits(cfg, source.report)
    return source


def open_env_task(cfg, tokenizer, model_config):
    """`env:<name>[:records.jsonl]` (envs/source.py): an episode's transcript (model and environment turns) is up
    to the environment's `max_total_tokens`, so that, not max_new_tokens (one turn's cap), sizes the context
    and the batch checks; prompts are the environment's openings (the first 64 records rendered)."""
    from asyncrl.envs.source import open_env_source
    from asyncrl.tasks.sources import encode_prompt

    source = open_env_source(cfg.task, seed=cfg.seed, tokenizer=tokenizer)
    longest = max(len(encode_prompt(tokenizer, source._prompt(i).text)) for i in range(min(len(source.env_records), 64)))
    transcript = max(cfg.max_new_tokens, source.limits.max_total_tokens)
    if longest > prompt_budget(model_config, transcript):
        raise PreflightError(f"an opening of {longest} tokens + an episode of up to {transcript} tokens exceeds the "
                             f"model's context: lower the environment's max_total_tokens or use a longer-context model")
    need = sealed_batch_bytes(prompts_per_lease=cfg.prompts_per_lease, group_size=cfg.group_size,
                              max_new_tokens=transcript, prompt_tokens=longest, episodes=True)
    if need > cfg.max_batch_bytes:
        raise PreflightError(f"a full batch of episodes (up to {transcript} tokens each) may take {need} bytes > "
                             f"max_batch_bytes={cfg.max_batch_bytes}: raise it or lower prompts_per_lease")
    return source


def context_needed(source, max_new_tokens: int) -> int:
    """Tokens (prompt + completion) the longest sequence of this task needs, for the manifest: volunteers size
    their engine's context to it. 0 (not said) without a checked record list, or when a record is a
    multi-turn environment, whose context grows turn by turn."""
    report, records = getattr(source, "report", None), getattr(source, "records", None)
    if report is None or not records or any(r.reward.startswith("env:") for r in records):
        return 0
    return report.longest_prompt_tokens + max_new_tokens


def sealed_batch_bytes(*, prompts_per_lease: int, group_size: int, max_new_tokens: int, prompt_tokens: int,
                       episodes: bool = False) -> int:
    payload = messages.rollout_batch_bytes_bound(groups=prompts_per_lease, group_size=group_size,
                                                 max_new_tokens=max_new_tokens, prompt_tokens=prompt_tokens,
                                                 episodes=episodes)
    return envelope.sealed_size_bound("rollout_batch", payload)


def check_batch_fits(cfg, longest_prompt_tokens: int) -> int:
    """Raise unless a full batch fits `cfg.max_batch_bytes`; returns its bound in bytes."""
    need = sealed_batch_bytes(prompts_per_lease=cfg.prompts_per_lease, group_size=cfg.group_size,
                              max_new_tokens=cfg.max_new_tokens, prompt_tokens=longest_prompt_tokens)
    if need > cfg.max_batch_bytes:
        raise PreflightError(
            f"a full rollout batch does not fit max_batch_bytes={cfg.max_batch_bytes}: prompts_per_lease="
            f"{cfg.prompts_per_lease} groups x group_size={cfg.group_size} completions x max_new_tokens="
            f"{cfg.max_new_tokens} tokens (8 bytes each: id + logprob), prompts up to {longest_prompt_tokens} tokens, "
            f"is up to {need} bytes signed. Raise max_batch_bytes to at least {need} (and inbound_bytes to twice "
            "that), or lower prompts_per_lease, group_size or max_new_tokens")
    return need


GRANT_OVERHEAD_BYTES = 1024
"""Per lease, on top of its prompt text, token ids and columns: ids, reward spec, sampling, msgpack framing
(all capped at well under this)."""


def check_grant_fits(cfg, report) -> int:
    """Raise unless `prompts_per_lease` leases of the largest record (tasks/sources.py SourceReport: the
    answer is inside the columns, so twice the columns bound it) fit one LeaseGrant a volunteer reads."""
    per_lease = (report.longest_text_bytes + 4 * report.longest_prompt_tokens + 2 * report.longest_columns_bytes
                 + GRANT_OVERHEAD_BYTES)
    need = cfg.prompts_per_lease * per_lease + GRANT_OVERHEAD_BYTES
    if need > limits.MAX_LEASE_GRANT_BYTES:
        raise PreflightError(
            f"a lease grant of prompts_per_lease={cfg.prompts_per_lease} of the largest records (prompt "
            f"{report.longest_prompt_tokens} tokens / {report.longest_text_bytes} bytes, columns "
            f"{report.longest_columns_bytes} bytes) may take {need} bytes; volunteers read at most "
            f"{limits.MAX_LEASE_GRANT_BYTES}: lower prompts_per_lease or drop large columns from the dataset")
    return need
