"""The environment interface, its limits and its registry (entry-point group `asyncrl.envs`).

An environment turns one task record into an episode: `reset(record, seed)` gives the opening messages and a
state; after each assistant turn `step(state, assistant_text)` gives the environment's answer (messages in
the chat's own roles: "tool" results, "user" feedback), whether the episode is over, and an optional step
reward; `final_reward(state)` closes it. Episode reward = sum of step rewards + final reward.

Determinism is the contract that makes an episode verifiable: given (record, seed, the assistant turns so
far) every call returns the same values on every machine, so the coordinator replays the environment over a
volunteer's transcript and compares each environment message token for token (envs/episode.py). State is
plain Python owned by the caller; an environment keeps nothing between calls outside it. Randomness comes
from `random.Random(seed)` stored in the state, never from the clock, the network or a global RNG.

Registry: built-ins (`calculator`, `echo`) and any package's `[project.entry-points."asyncrl.envs"]`
entry, each a class (or factory) taking no arguments. A lease names one as the reward spec `env:<name>`
(tasks/ keeps rewards; `is_env_spec` tells them apart). `pin(name)` = (name, package, version, sha256 of
the module's source) is what the coordinator publishes and a volunteer compares before it starts.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

ENV_PREFIX = "env:"


@dataclass(frozen=True)
class EnvLimits:
    """Per-episode bounds, part of the environment (both sides read the same values from its package).
    Tokens count after the prompt: `max_total_tokens` bounds model + environment tokens of the transcript."""

    max_turns: int = 4             # assistant turns
    max_env_tokens: int = 256      # environment tokens in the whole episode
    max_total_tokens: int = 512    # model + environment tokens after the prompt
    step_timeout_s: float = 5.0    # wall seconds for one reset/step on the volunteer (and on the replay)

    def __post_init__(self):
        if self.max_turns < 1 or self.max_env_tokens < 0 or self.max_total_tokens < 1 or self.step_timeout_s <= 0:
            raise ValueError(f"bad environment limits {self}")


@dataclass
class StepResult:
    messages: list[dict]           # [{"role": "tool" | "user", "content": str}, ...]; [] when done
    done: bool
    reward: float = 0.0


@dataclass
class Reset:
    messages: list[dict]           # the opening chat (system / user turns) the model answers first
    state: Any
    tools: list[dict] = field(default_factory=list)  # JSON schemas shown to the chat template (`tools=`)


class Environment(Protocol):
    name: str
    limits: EnvLimits

    def reset(self, record: dict, seed: int) -> Reset: ...

    def step(self, state: Any, assistant: str) -> StepResult: ...

    def final_reward(self, state: Any) -> float: ...


class EnvError(Exception):
    """The environment itself failed (raised, hung past its step limit, returned nonsense): the episode has
    no verdict. On a volunteer it costs only that lease; at ingest it means unscorable, never a strike."""


class UnknownEnv(KeyError):
    pass


_BUILTIN = {"calculator": "asyncrl.envs.calculator:CalculatorEnv", "echo": "asyncrl.envs.echo:EchoGame"}
_CACHE: dict[str, Environment] = {}


def is_env_spec(spec: str) -> bool:
    return spec.startswith(ENV_PREFIX)


def env_name(spec: str) -> str:
    return spec[len(ENV_PREFIX):]


def _target(name: str) -> str:
    if name in _BUILTIN:
        return _BUILTIN[name]
    from importlib.metadata import entry_points

    for ep in entry_points(group="asyncrl.envs"):
        if ep.name == name:
            return ep.value
    raise UnknownEnv(f"unknown environment {name!r}; built-in: {sorted(_BUILTIN)} (or install the package "
                     f"that registers it under the `asyncrl.envs` entry-point group)")


def _load(target: str):
    import importlib

    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def get_env(name: str) -> Environment:
    """The environment registered as `name` (one instance per process: environments hold no state)."""
    if name not in _CACHE:
        env = _load(_target(name))()
        for attr in ("reset", "step", "final_reward", "limits"):
            if not hasattr(env, attr):
                raise TypeError(f"environment {name!r} has no {attr!r}")
        _CACHE[name] = env
    return _CACHE[name]


def pin(name: str) -> dict:
    """What both sides must agree on: the environment's distribution, its version and a hash of the source of
    the module that defines it (a volunteer with another copy refuses to start: `check_pin`)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    target = _target(name)
    import importlib

    module = importlib.import_module(target.partition(":")[0])
    top = module.__name__.split(".")[0]
    dist = (packages_distributions().get(top) or [top])[0]
    try:
        ver = version(dist)
    except PackageNotFoundError:
        ver = "0"
    source = inspect.getsource(module).encode()
    return {"name": name, "package": dist, "version": ver, "sha256": hashlib.sha256(source).hexdigest()}


def check_pin(expected: dict) -> tuple[str, str] | None:
    """None when this machine's environment matches `expected` (a `pin`); else (what differs, the install
    line). The volunteer prints both and does not start; nothing is anyone's fault."""
    install = f"pip install '{expected.get('package', '?')}=={expected.get('version', '?')}'"
    try:
        mine = pin(str(expected.get("name", "")))
    except (UnknownEnv, ImportError) as exc:
        return f"environment {expected.get('name')!r} is not installed here ({exc})", install
    if mine != expected:
        return (f"environment {expected.get('name')!r} differs from the coordinator's: here {json.dumps(mine)}, "
                f"there {json.dumps(expected)}"), install
    return None
