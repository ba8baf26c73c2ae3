"""The volunteer's side of multi-turn episodes: play a leased environment turn by turn on the engine.

A lease whose reward spec names an environment (`env:<name>`, envs/base.py) is not one generate call: each
of its G episodes is reset from the lease's record and the seed its prompt id gives, and every turn all live
episodes are sent to the engine as prompts of one sample each (their whole context so far: the transformers
engine re-prefills it; vLLM's prefix cache reuses it), capped at each episode's own budget. The environment
answers on this machine under its per-step time limit; an `EnvError` (it raised or hung) costs this lease
only (client/rollout.py abandons it), never the volunteer. The coordinator replays every episode
(coordinator/ingest/episodes.py), so rewards here are the environment's, not a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from asyncrl.protocol import messages

ENV_PREFIX = "env:"  # asyncrl.envs.ENV_PREFIX (envs is imported only when an episode lease arrives)


@dataclass
class EpisodeSample:
    """One finished episode, shaped like engine.Sample (not imported: that module loads torch) plus its
    1-per-environment-token mask and the environment's reward; log-probs are 0.0 on environment tokens."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    env_mask: list[int]
    reward: float


def is_episode_lease(lease: messages.TaskLease) -> bool:
    return lease.reward.startswith(ENV_PREFIX)


def turn_generator(engine, sampling: messages.SamplingParams):
    """envs.TurnGenerator over an asyncrl Engine: one call per distinct turn cap, one sample per context."""

    def generate(contexts: list[list[int]], caps: list[int]) -> list[tuple[list[int], list[float]]]:
        out: list = [None] * len(contexts)
        for cap in sorted(set(caps)):
            idx = [i for i, c in enumerate(caps) if c == cap]
            turn = msgspec.structs.replace(sampling, max_new_tokens=cap)
            for i, group in zip(idx, engine.generate([contexts[i] for i in idx], 1, turn)):
                out[i] = (list(group[0].token_ids), list(group[0].logprobs))
        return out

    return generate


def generate_episodes(engine, lease: messages.TaskLease, group_size: int,
                      sampling: messages.SamplingParams) -> list[EpisodeSample]:
    """G episodes of one leased environment prompt (raises envs.EnvError when the environment fails here)."""
    from asyncrl import envs

    env = envs.get_env(envs.env_name(lease.reward))
    start = (envs.record_of(lease.columns, lease.answer), envs.seed_for(lease.prompt_id))
    sessions = envs.run_episodes(env, envs.Renderer(engine.tokenizer), [start] * group_size,
                                 turn_generator(engine, sampling), stop_token_ids=tuple(engine.stop_token_ids),
                                 max_new_tokens=sampling.max_new_tokens)
    leased = np.frombuffer(lease.prompt_token_ids, dtype="<i4").tolist()
    if sessions and sessions[0].prompt_ids != leased:
        raise envs.EnvError("this environment renders another opening than the leased prompt (a different "
                            "environment or tokenizer version than the coordinator's)")
    return [EpisodeSample(s.tokens, s.logprobs, s.finish_reason, env_mask=s.env_mask, reward=s.reward)
            for s in sessions]


def episode_completion(sample: EpisodeSample) -> messages.Completion:
    return messages.Completion(token_ids=np.asarray(sample.token_ids, dtype="<i4").tobytes(),
                               logprobs=np.asarray(sample.logprobs, dtype="<f4").tobytes(), reward=sample.reward,
                               finish_reason=sample.finish_reason,
                               env_mask=np.asarray(sample.env_mask, dtype=np.uint8).tobytes())
