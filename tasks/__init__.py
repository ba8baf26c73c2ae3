"""asyncrl.tasks — what volunteers are asked to do and how it is scored; imported by both sides.

  prompt.py       `Prompt`: one task record as leased
  toy.py          the built-in `repeat` toy task and its reward (docs/toy-task.md)
  rewards.py      the reward registry (built-ins + the `asyncrl.rewards` entry points); TRL-form rewards (any
                  function GRPOTrainer accepts) and declared simple ones, weighted reward specs; `score_group` (both sides), `score`, and
                  `PrintableTable` / `impossible`: re-scoring `exact` without decoding a hopeless completion
  math_reward.py  the `math` reward: math-verify, each check in its own time-limited worker process;
                  `Unscorable` (a check that cannot finish is not a score)
  sources.py      `--task` specs: toy, JSONL, Hugging Face datasets, reasoning-gym; chat templates; `encode_prompt`
  rgym.py         reasoning-gym generators: disjoint train/eval splits, its system prompts, the `reasoning_gym`
                  reward (the dataset's own score_answer on the <answer> tag text)

Imports neither the coordinator nor the client (tests/test_layering.py): the coordinator re-scores
with exactly the code the volunteer scored with.
"""

from .prompt import Prompt
from .math_reward import Unscorable, scoring_for
from .rewards import (REWARDS, GroupScore, PrintableTable, RewardError, RewardState, UnknownReward, batch_reward,
                      check_reward, exact_reward, get_reward, impossible, math_reward, reward_package, score,
                      score_group, simple_reward, trl_reward)
from .toy import REPEAT_LEN, REPEAT_LETTERS, TASKS, get_task, repeat_reward, repeat_task

__all__ = ["Prompt", "REWARDS", "GroupScore", "PrintableTable", "RewardError", "batch_reward", "impossible", "score_group",
           "simple_reward", "trl_reward", "check_reward", "RewardState", "reward_package", "Unscorable", "scoring_for", "UnknownReward", "exact_reward", "get_reward", "math_reward",
           "score", "REPEAT_LEN",
           "REPEAT_LETTERS", "TASKS", "get_task", "repeat_reward", "repeat_task"]
