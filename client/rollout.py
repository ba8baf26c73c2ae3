"""Rollout: leased prompts turned into a scored RolloutBatch in the outbox (a mixin of the hub's `Volunteer`).

Owns generation and scoring, the two steps between a lease and the outbox:

  _generate_work   engine thread: every leased prompt in one engine call (`_generate`), or prompt by prompt
                   under --only-when-idle (`_generate_politely`: leases not started on a pause go back)
  _generate        the engine call, and what it cannot serve: a prompt too long for the engine's context is
                   not tried, an engine error is retried lease by lease, a multi-turn lease is played by
                   client/episodes.py; each such lease is abandoned alone (`_abandon`), never the volunteer
  _finish_work     scorer thread (client/pipeline.py Stage): score each group with the coordinator's own
                   reward call, leave out leases the keeper lost, build the RolloutBatch and spool it
                   (client/delivery.py); groups nobody can score are returned as `unscorable`
  engine_dtype / engine_kind   what a batch says about the engine that made it (the audit's tolerance key)

It reads the hub's `engine`, `serving_version`, `polite`, `status`, `display`, `name`, `run_id`, and calls
the lease calls (client/lease_rpc.py `_release`, `_measured`) and the delivery (`_spool`, `_kick_uploads`).
"""

from __future__ import annotations

import time

import numpy as np

from asyncrl import tasks
from asyncrl.envs import EnvError
from asyncrl.protocol import limits, messages

from .delivery import PendingAck
from .episodes import episode_completion, generate_episodes, is_episode_lease
from .lease_rpc import Work
from .outbox import OutboxFull

ENGINE_FAILURE_STREAK = 3  # works in a row in which the engine served no lease at all: the engine is broken


class EngineFailed(RuntimeError):
    """The engine failed every lease of several works in a row: it is broken, not one prompt."""


def engine_dtype(engine) -> str:
    """The wire name of the dtype an engine computes logprobs in ("" when it does not say)."""
    name = str(getattr(engine, "dtype", "")).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, "")


def engine_kind(engine) -> str:
    """The wire name of an engine's kind (its `name`: "transformers", "vllm"; "" when it has none or one the
    wire cannot carry): the coordinator learns an audit tolerance per kind and dtype."""
    name = str(getattr(engine, "name", "")).lower()
    return name if 0 < len(name) <= 32 and all(c.isalnum() or c in "_.-" for c in name) and name.isascii() else ""


class Rollout:
    def _abandon(self, lease: messages.TaskLease, why: str, *, counter: str) -> None:
        """Give up one lease and go on with the rest: its group is not sent, the lease is not renewed (it
        expires and the prompt goes to someone else)."""
        self._count(counter)
        self._count("leases_abandoned")
        self.display.event("warning", f"[{self.name}] lease {lease.lease_id} (prompt {lease.prompt_id}) "
                           f"abandoned: {why}", code=counter)

    def _generate(self, leases: list[messages.TaskLease], group_size: int, sampling) -> list[tuple]:
        """(lease, samples) for every lease the engine could serve. A lease whose prompt plus max_new_tokens
        does not fit this engine's context is not tried (a shorter completion would be refused); an engine
        error is retried lease by lease, so one bad prompt costs its own lease, never the others or the
        volunteer. Only an engine that fails every lease of ENGINE_FAILURE_STREAK works in a row stops us."""
        limit = getattr(self.engine, "context_limit", None)
        todo = []
        for lease in leases:
            n = len(lease.prompt_token_ids) // 4
            if limit is not None and n + sampling.max_new_tokens > limit:
                self._abandon(lease, f"prompt of {n} tokens + max_new_tokens {sampling.max_new_tokens} exceeds "
                              f"this engine's context of {limit} tokens", counter="leases_too_long")
            else:
                todo.append(lease)
        episodes = [(l, self._episodes(l, group_size, sampling)) for l in todo if is_episode_lease(l)]
        episodes = [(l, samples) for l, samples in episodes if samples is not None]
        todo = [l for l in todo if not is_episode_lease(l)]
        if not todo:
            return episodes
        prompts = [np.frombuffer(l.prompt_token_ids, dtype="<i4").tolist() for l in todo]
        try:
            done = list(zip(todo, self.engine.generate(prompts, group_size, sampling)))
            self._engine_failures = 0
            return episodes + done
        except Exception as exc:  # noqa: BLE001 - any engine error: find the lease it belongs to
            first = exc
        done = []
        if len(todo) == 1:
            self._abandon(todo[0], f"engine error: {first.__class__.__name__}: {str(first)[:300]}",
                          counter="engine_errors")
        else:
            for lease, prompt in zip(todo, prompts):
                try:
                    done.append((lease, self.engine.generate([prompt], group_size, sampling)[0]))
                except Exception as exc:  # noqa: BLE001
                    self._abandon(lease, f"engine error: {exc.__class__.__name__}: {str(exc)[:300]}",
                                  counter="engine_errors")
        self._engine_failures = 0 if done else getattr(self, "_engine_failures", 0) + 1
        if self._engine_failures >= ENGINE_FAILURE_STREAK:
            raise EngineFailed(f"the engine failed every lease of {self._engine_failures} works in a row; last "
                               f"error: {first.__class__.__name__}: {str(first)[:300]}") from first
        return episodes + done

    def _episodes(self, lease, group_size: int, sampling) -> list | None:
        """A multi-turn lease played turn by turn (client/episodes.py); an environment that fails here costs
        this lease only (None)."""
        try:
            return generate_episodes(self.engine, lease, group_size, sampling)
        except EnvError as exc:
            self._abandon(lease, f"environment failed: {str(exc)[:300]}", counter="env_errors")
            return None

    def _generate_politely(self, leases, group_size: int, sampling) -> tuple[list[tuple], list, str | None]:
        """(generated, unfinished, pause reason). With --only-when-idle one prompt at a time, asking
        IdleWatch between them: when the machine is wanted, the leases not yet started are left for the
        caller to return. Otherwise all prompts in one engine call (vLLM batches them)."""
        if not self.cfg.only_when_idle:
            return self._generate(leases, group_size, sampling), [], None
        generated = []
        for i, lease in enumerate(leases):
            if i:
                reason = self.polite.busy()
                if reason is not None:
                    return generated, list(leases[i:]), reason
            self.status.state, self.status.lease_progress = "generating", [i, len(leases)]
            self._write_status()
            generated += self._generate([lease], group_size, sampling)
        return generated, [], None

    def _generate_work(self, work: Work) -> float:
        """Engine thread: generate every leased prompt in one engine call; returns the seconds it took."""
        work.version = self.serving_version  # what the batch is tagged with: the adapter it was generated with
        t0 = time.perf_counter()
        self.status.state = "generating"
        work.generated, work.unfinished, work.reason = self._generate_politely(
            work.leases, work.leases[0].group_size, work.leases[0].sampling)
        busy = time.perf_counter() - t0
        self.status.engine_busy_s += busy
        self.status.state = "working"
        if work.unfinished:  # paused mid-lease: the rest goes back to the coordinator now, before we rest
            self._release(work.unfinished, work.reason)
        return busy

    def _finish_work(self, work: Work) -> int:
        """Scorer (off the engine thread): score each group, leave out lost leases, spool the batch, wake the
        uploader; returns the number of groups spooled. The keeper renews the leases until the batch is
        built: a reward check can take its whole time limit per group (a stuck math check: 10 s)."""
        results = []
        try:
            for lease, group in work.generated:
                texts = [self.engine.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group]
                prompt = tasks.Prompt(lease.prompt_id, lease.prompt, lease.answer, lease.reward, lease.columns)
                if is_episode_lease(lease):  # the environment scored its episodes as they were played
                    results.append((lease, group, [s.reward for s in group]))
                    continue
                try:  # the coordinator re-scores with this same call (coordinator/ingest/ingest.py)
                    results.append((lease, group, tasks.score_group(prompt, texts, [s.token_ids for s in group],
                                                                   version=work.version).rewards))
                except Exception as exc:  # noqa: BLE001 - a broken reward costs its group, not the volunteer
                    results.append((lease, group, exc))
        finally:
            work.keeper.finish()
        keeper = work.keeper
        self._count("lease_renewals", keeper.renewals)
        groups, unscored, raised, lost = [], [], [], 0
        for lease, group, scored in results:
            if lease.lease_id in keeper.lost:
                self._abandon(lease, "the coordinator no longer holds it for us (expired)", counter="leases_lost")
                lost += 1
                continue
            if isinstance(scored, Exception):
                exc = scored
                why = f"reward {lease.reward!r} failed: {exc.__class__.__name__}: {str(exc)[:300]}"
                if isinstance(exc, tasks.Unscorable):  # our verifier could not finish: send nothing rather than a guess
                    self._count("groups_unscorable")
                    unscored.append(lease)
                else:  # the reward function itself raised: the operator must see it (coordinator's log, dashboard)
                    raised.append((lease, why))
                self._abandon(lease, why, counter="reward_errors")
                continue
            comps = []
            for s, reward in zip(group, scored):
                comps.append(episode_completion(s) if is_episode_lease(lease) else messages.Completion(
                    token_ids=np.asarray(s.token_ids, dtype="<i4").tobytes(),
                    logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(), reward=reward,
                    finish_reason=s.finish_reason))
                self.status.rollouts += 1
                self.status.tokens += len(s.token_ids)
                self.status.reward_sum += reward
            groups.append(messages.RolloutGroup(lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                                                prompt_token_ids=lease.prompt_token_ids, completions=tuple(comps)))
        if unscored:  # said at once: the prompt goes to someone else now, and a poison prompt gets retired
            self._release(unscored, "reward check did not finish", unscorable=True)
        if raised:
            self._release([l for l, _ in raised], "reward raised",
                          reward_error=raised[0][1][:limits.MAX_REWARD_ERROR_CHARS])
        tried = len(work.leases) - len(work.unfinished)  # a pause returns the rest
        if not groups:
            if lost:  # grant to losing it: the sizer learns this machine is too slow for what it asked
                self._measured(tried, work.granted_at)
            return 0
        batch = messages.RolloutBatch(run_id=self.run_id, adapter_version=work.version, client_name=self.name,
                                      sampling=work.leases[0].sampling, groups=tuple(groups), generated_at=time.time(),
                                      engine_dtype=engine_dtype(self.engine), engine_kind=engine_kind(self.engine))
        try:
            spooled = self._spool(batch)
        except OutboxFull as exc:  # the disk cap: these leases expire; the engine thread pauses near the cap
            self.display.event("warning", str(exc))
            return 0
        pending = PendingAck(tried, work.granted_at)
        for batch_id in spooled:
            self._awaiting_ack[batch_id] = pending
        self._write_status()
        self._kick_uploads()
        return len(groups)

