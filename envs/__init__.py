"""asyncrl.envs — multi-turn and tool-use environments whose episodes the coordinator verifies by replay.

  base.py        the interface (`reset` / `step` / `final_reward`), `EnvLimits`, the `asyncrl.envs`
                 entry-point registry, `pin` / `check_pin` (name, package, version, source hash)
  tools.py       tools as plain functions with a JSON schema; Qwen/Hermes `<tool_call>` parsing
  render.py      the opening prompt and each environment turn as tokens, through the chat template
  episode.py     `Session` (the one transition rule), `run_episodes` (volunteer), `replay` (coordinator)
  calculator.py  arithmetic word problems with a `calculate` tool (JSONL records)
  echo.py        a three-turn letter game with feedback the tiny model learns
  verifiers_adapter.py  wraps a `verifiers`-style multi-turn environment when it can be replayed

Imports protocol and tasks only, never the coordinator or the client (tests/test_layering.py).
docs/environments.md is the researcher's guide.
"""

from .base import (ENV_PREFIX, EnvError, EnvLimits, Environment, Reset, StepResult, UnknownEnv, check_pin, env_name,
                   get_env, is_env_spec, pin)
from .episode import EpisodeMismatch, Session, guarded, record_of, replay, run_episodes, seed_for, segments
from .render import Renderer
from .tools import Tool, ToolCall, parse_tool_calls, run_tool_calls, tool

__all__ = ["ENV_PREFIX", "EnvError", "EnvLimits", "Environment", "EpisodeMismatch", "Renderer", "Reset", "Session",
           "StepResult", "Tool", "ToolCall", "UnknownEnv", "check_pin", "env_name", "get_env", "guarded",
           "is_env_spec", "parse_tool_calls", "pin", "record_of", "replay", "run_episodes", "run_tool_calls",
           "seed_for", "segments", "tool"]
