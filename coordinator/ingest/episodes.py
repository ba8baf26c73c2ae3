"""Ingest's check of multi-turn episodes: replay the environment over each claimed transcript.

A group whose lease names an environment (reward spec `env:<name>`, envs/base.py) is verified here instead
of by `ingest.rescore_group`'s single-answer path. For each completion: split the transcript by its
`env_mask`, walk the model turns through the environment's own `Session` (envs/episode.py) and compare
every environment token with what the environment renders (ENV_MISMATCH at the first difference: an edited
tool result, a dropped or added turn, a fake environment message, model tokens marked as environment
tokens, a transcript cut short or run past its end); then the claimed finish reason and reward must equal
the replay's (an episode's reward is a pure function of the replayed transcript and the pinned environment,
so a different claim is proof, ENV_MISMATCH too). An environment that raises or passes its step limit here
makes the group unscorable (tasks.Unscorable): nobody is blamed for our environment.

Cost is bounded by the environment's limits (turns, tokens) and its per-step time limit; `replay_ms` keeps
the time of recent replays (the dashboard's and bench/env_replay.py's figure).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from asyncrl import tasks
from asyncrl.protocol import messages
from asyncrl.protocol.errors import ProtocolError, RejectCode

from ..learner.learner import TrainGroup, sampling_knobs

REWARD_TOLERANCE = 1e-6
ENV_PREFIX = "env:"  # envs.ENV_PREFIX; asyncrl.envs itself is imported only when an episode arrives
replay_ms: deque[float] = deque(maxlen=1024)  # per episode, newest last


def environment_pin(task: str) -> str:
    """The handshake's pin of the run's environment (JSON, envs/base.py `pin`), "" for other tasks."""
    if not task.startswith(ENV_PREFIX):
        return ""
    import json

    from asyncrl import envs

    return json.dumps(envs.pin(task[len(ENV_PREFIX):].partition(":")[0]), sort_keys=True)


def replay_metrics() -> dict:
    """For the learner's `step` event (metrics.jsonl, the dashboard's /status and /metrics): the median replay
    time per episode over the recent ones; {} in a run without episodes."""
    if not replay_ms:
        return {}
    recent = sorted(replay_ms)
    return {"episode_replay_ms": recent[len(recent) // 2]}


def is_episode_lease(lease) -> bool:
    return lease.prompt.reward.startswith(ENV_PREFIX)


def rescore_episode_group(tokenizer, group: messages.RolloutGroup, lease, batch: messages.RolloutBatch, *,
                          stop_token_ids: tuple[int, ...] = ()) -> TrainGroup:
    """One leased group of episodes, replayed and re-scored; a TrainGroup whose env_masks keep the
    environment tokens out of the loss and the audit."""
    from asyncrl import envs

    try:
        env = envs.get_env(envs.env_name(lease.prompt.reward))
    except envs.UnknownEnv as exc:  # our install lacks it: not the volunteer's fault
        raise tasks.Unscorable(str(exc)) from None
    renderer = envs.Renderer(tokenizer)
    stops = tuple(stop_token_ids) or (tokenizer.eos_token_id,)
    record = envs.record_of(lease.prompt.columns, lease.prompt.answer)
    seed = envs.seed_for(lease.prompt.prompt_id)
    prompt_ids = np.frombuffer(group.prompt_token_ids, dtype="<i4").tolist()
    if lease.prompt_token_ids is not None and bytes(group.prompt_token_ids) != lease.prompt_token_ids:
        raise ProtocolError(RejectCode.MALFORMED, "prompt tokens differ from the leased prompt")
    arrays, masks, rewards, truncated = [], [], [], []
    for i, c in enumerate(group.completions):
        ids = c.token_array()
        mask = c.env_mask_array()
        mask = np.zeros(len(ids), dtype=np.uint8) if mask is None else mask
        t0 = time.perf_counter()
        try:
            session = envs.replay(env, renderer, record=record, seed=seed, prompt_ids=prompt_ids, tokens=ids.tolist(),
                                  env_mask=mask.tolist(), stop_token_ids=stops,
                                  max_new_tokens=batch.sampling.max_new_tokens)
        except envs.EpisodeMismatch as exc:
            raise ProtocolError(RejectCode.ENV_MISMATCH, f"completion {i}: {exc}") from None
        except envs.EnvError as exc:
            raise tasks.Unscorable(f"environment failed on replay: {exc}") from None
        finally:
            replay_ms.append((time.perf_counter() - t0) * 1e3)
        if session.finish_reason != c.finish_reason:
            raise ProtocolError(RejectCode.ENV_MISMATCH, f"completion {i}: finish_reason {c.finish_reason!r}, "
                                                         f"the replay says {session.finish_reason!r}")
        if abs(session.reward - c.reward) > REWARD_TOLERANCE:
            raise ProtocolError(RejectCode.ENV_MISMATCH, f"completion {i}: claimed reward {c.reward:.4f}, "
                                                         f"the replay gives {session.reward:.4f}")
        arrays.append(ids)
        masks.append(mask)
        rewards.append(session.reward)
        truncated.append(session.finish_reason == "length")
    return TrainGroup(prompt_ids, arrays, [c.logprob_array() for c in group.completions], rewards,
                      batch.adapter_version, batch.sampling.temperature,
                      batch.client_name, truncated=truncated, env_masks=masks, **sampling_knobs(batch.sampling))
