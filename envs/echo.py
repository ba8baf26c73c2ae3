"""`echo`: a three-turn game with feedback, small enough for the built-in tiny model to learn.

Each turn the environment names a letter ("say c"); the model should answer with that letter alone. After
each answer it says how that went and names the next letter ("ok. say a" / "no, c. say a"). Letters come
from `random.Random(seed)` (the seed is the prompt's: envs/episode.py `seed_for`), so a group of episodes
plays the same sequence. Per turn: 1 for exactly the letter, 0.5 when the answer starts with it, else 0;
the episode's reward is the mean over its `TURNS` turns. Every character is in the tiny model's vocabulary
(models/tinymodel.py CHARS: no newlines), and the record is ignored beyond its optional "letters".
"""

from __future__ import annotations

import random

from .base import EnvLimits, Reset, StepResult

TURNS = 3
LETTERS = "abcd"


class EchoGame:
    name = "echo"
    limits = EnvLimits(max_turns=TURNS, max_env_tokens=64, max_total_tokens=96, step_timeout_s=2.0)

    def reset(self, record: dict, seed: int) -> Reset:
        letters = str(record.get("letters") or LETTERS)
        rng = random.Random(seed)
        state = {"targets": [rng.choice(letters) for _ in range(TURNS)], "turn": 0, "score": 0.0}
        return Reset([{"role": "user", "content": f"echo game: say {state['targets'][0]}"}], state)

    def step(self, state: dict, assistant: str) -> StepResult:
        target, said = state["targets"][state["turn"]], assistant.strip()
        points = 1.0 if said == target else 0.5 if said.startswith(target) else 0.0
        state["score"] += points
        state["turn"] += 1
        if state["turn"] >= TURNS:
            return StepResult([], done=True)
        feedback = "ok." if points == 1.0 else f"no, {target}."
        return StepResult([{"role": "user", "content": f"{feedback} say {state['targets'][state['turn']]}"}],
                          done=False)

    def final_reward(self, state: dict) -> float:
        return state["score"] / TURNS
