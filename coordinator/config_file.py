"""Coordinator config files: TOML in, one validated `CoordinatorConfig` out.

Precedence, lowest first: the dataclass defaults (coordinator/config.py) < the model's preset (the
built-in tiny model's `config.TINY_PRESET`, smollm2-135m-instruct's `config.SMOLLM2_PRESET`) < the
`--config` TOML files, in the order given (a later file's key wins; tables merge key by key) < command-line
flags. TRL GRPOConfig key names are accepted where they mean the same (`GRPO_ALIASES`: learning_rate,
num_generations, max_completion_length, beta, ...) and refused naming asyncrl's key where they do not
(`GRPO_REFUSED`). Keys are the config's field names; `[loss]` is the nested `LossConfig` table.
Every value is type-checked against the field's annotation and an unknown key is an error that names
it (with the nearest known key), so a typo never silently runs with a default. TOML has no null:
for fields that accept None (e.g. `max_staleness`) a negative number means None, as on the CLI.

The annotated example in `configs/coordinator.example.toml` is generated from the dataclass source —
each field's docstring (or trailing comment) becomes its comment — so it never drifts:

    asyncrl-coordinator example-config > configs/coordinator.example.toml

Owned by the operator-experience work (issue 8); coordinator/config.py owns the fields themselves.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from .config import ConfigError, CoordinatorConfig, model_preset

EXAMPLE_PATH = "configs/coordinator.example.toml"


# ---- TRL's GRPOConfig names ----------------------------------------------------------------------------
GRPO_ALIASES = {
    "learning_rate": "lr", "num_generations": "group_size", "max_completion_length": "max_new_tokens",
    "lr_scheduler_type": "lr_scheduler", "output_dir": "run_dir", "save_steps": "checkpoint_every",
    "save_total_limit": "keep_checkpoints", "num_completions_to_print": "log_completions_count",
    "beta": "loss.beta", "epsilon": "loss.epsilon", "epsilon_high": "loss.epsilon_high",
    "loss_type": "loss.loss_type", "scale_rewards": "loss.scale_rewards", "mask_truncated_completions":
    "loss.mask_truncated",
}
"""TRL GRPOConfig keys accepted in a config file with the same meaning as the asyncrl key they name (`temperature`,
`top_p`, `top_k`, `min_p`, `repetition_penalty`, `seed`, `max_steps`, `warmup_steps`, `reward_weights`,
`report_to` have the same name in both; TRL's `min_p = None` is 0 here, as TOML has no null)."""
GRPO_REFUSED = {
    "per_device_train_batch_size": "groups_per_step (prompts per optimizer step; each brings group_size completions)",
    "gradient_accumulation_steps": "micro_batch_tokens (a step accumulates over as many micro-batches as it needs)",
    "generation_batch_size": "prompts_per_lease (prompts per volunteer lease) and groups_per_step",
    "steps_per_generation": "max_staleness (how many adapter versions old a batch may be)",
    "num_iterations": "nothing: every batch is trained once (asynchronous GRPO; max_staleness bounds its age)",
    "max_prompt_length": "oversized_records (a prompt must leave max_new_tokens of the model's context)",
    "use_vllm": "the volunteers' engine: asyncrl-client join --engine vllm",
    "vllm_mode": "the volunteers' engine: asyncrl-client join --engine vllm",
    "importance_sampling_level": "loss.correction (tis-token or tis-sequence)",
    "log_completions": "log_completions_every (0 = never)",
    "logging_steps": "nothing: metrics.jsonl has every step",
}
"""TRL GRPOConfig keys whose meaning differs here: refused, naming what asyncrl has instead."""


def apply_grpo_aliases(values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` with TRL GRPOConfig names renamed to asyncrl's (GRPO_ALIASES); a refused name (GRPO_REFUSED)
    or a name given both ways is a ConfigError."""
    out = copy.deepcopy(dict(values))
    for trl_name, why in GRPO_REFUSED.items():
        if trl_name in out:
            raise ConfigError(f"{trl_name!r} in {source} is TRL's GRPOConfig name, which asyncrl does not take: "
                              f"use {why}")
    for trl_name, ours in GRPO_ALIASES.items():
        if trl_name not in out:
            continue
        value = out.pop(trl_name)
        table, _, key = ours.rpartition(".")
        target = out.setdefault(table, {}) if table else out
        if not isinstance(target, dict) or key in target:
            raise ConfigError(f"{source} sets both {trl_name!r} (TRL's name) and {ours!r}: keep one")
        target[key] = value
    return out


# ---- reading --------------------------------------------------------------------------------------
def load_configs(paths) -> tuple[dict[str, Any], str]:
    """Several TOML files merged in order (a later file's key wins, tables merged key by key), and the
    name of the merged source for error messages."""
    merged: dict[str, Any] = {}
    for path in paths:
        merged = _deep_merge(merged, apply_grpo_aliases(load_toml(path), str(path)))
    return merged, " + ".join(map(str, paths)) or "defaults"


def load_toml(path: str | Path) -> dict[str, Any]:
    import tomllib

    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def resolve_config(file_values: dict[str, Any] | None, overrides: dict[str, Any] | None = None,
                   *, source: str = "config file") -> CoordinatorConfig:
    """defaults < file_values < overrides (None values in overrides mean "not given"), validated."""
    file_values = apply_grpo_aliases(file_values or {}, source)
    overrides = _drop_none(overrides or {})
    # Check each layer on its own first, so an error names where the bad value came from...
    _coerce_table(CoordinatorConfig, file_values, prefix="", source=source)
    _coerce_table(CoordinatorConfig, overrides, prefix="", source="command line")
    # ...then merge key by key (nested tables too: --beta on the CLI keeps [loss] epsilon from the file).
    raw = _deep_merge(file_values, overrides)
    for key, value in model_preset(raw.get("model", CoordinatorConfig.model)).items():
        if isinstance(value, dict) and isinstance(raw.get(key, {}), dict):  # a table ([loss]): key by key
            for sub, v in value.items():
                raw.setdefault(key, {}).setdefault(sub, v)
        else:
            raw.setdefault(key, value)  # the model's preset, where nothing explicit was given
    if "lora_r" in raw and "lora_alpha" not in raw:
        raw["lora_alpha"] = 2.0 * raw["lora_r"]  # keep alpha / r = 2 unless alpha is set explicitly
    loss = raw.setdefault("loss", {})
    if isinstance(loss, dict) and "max_completion_length" not in loss:  # dr_grpo's normaliser follows the cap
        loss["max_completion_length"] = raw.get("max_new_tokens", CoordinatorConfig.max_new_tokens)
    merged = _coerce_table(CoordinatorConfig, raw, prefix="", source=f"{source} + command line")
    try:
        return CoordinatorConfig(**merged).validate()
    except TypeError as exc:  # a field the dataclass refuses (should have been caught above)
        raise ConfigError(str(exc)) from None


def _drop_none(d: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def overrides_from_args(args) -> dict[str, Any]:
    """argparse namespace -> {field: value} for the flags that name config fields (flags left at their
    None default are "not given"); flags named after a LossConfig field go into the `loss` table."""
    from .learner.loss_config import LossConfig

    top = {f.name for f in dataclasses.fields(CoordinatorConfig)}
    nested = {f.name for f in dataclasses.fields(LossConfig)}
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if value is None:
            continue
        if key in top:
            out[key] = value
        elif key in nested:
            out.setdefault("loss", {})[key] = value
    return out


def config_dests() -> list[str]:
    """Every name a command-line flag may use to override a config field (see overrides_from_args)."""
    from .learner.loss_config import LossConfig

    return [f.name for f in dataclasses.fields(CoordinatorConfig)] + [f.name for f in dataclasses.fields(LossConfig)]


def _coerce_table(cls, values: dict[str, Any], *, prefix: str, source: str) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in values.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {prefix}{near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown key {prefix}{key!r} in {source}{hint}")
        out[key] = _coerce(f"{prefix}{key}", value, hints[key], source)
    return out


def _coerce(key: str, value: Any, hint: Any, source: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{key} in {source} must be {expected}, got {value!r}")

    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (type(None) in args and isinstance(value, (int, float)) and not isinstance(value, bool)
                             and value < 0):
            return None
        for alt in inner[1:]:  # e.g. `str | tuple[str, ...]`: a list goes to the tuple alternative
            if isinstance(value, (list, tuple)) and typing.get_origin(alt) is tuple:
                return _coerce(key, value, alt, source)
        return _coerce(key, value, inner[0], source)
    if origin is typing.Literal:
        if value not in args:
            raise bad("one of " + ", ".join(repr(a) for a in args))
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        return tuple(_coerce(f"{key}[{i}]", v, args[0], source) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if dataclasses.is_dataclass(value):
            return value
        if not isinstance(value, dict):
            raise bad(f"a [{key}] table")
        return hint(**_coerce_table(hint, value, prefix=f"{key}.", source=source))
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    return value


# ---- the annotated example ------------------------------------------------------------------------
def field_docs(cls) -> dict[str, tuple[list[str], str]]:
    """{field: (section comment lines above it, its docstring or trailing comment)} read from source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][:tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    body = ast.parse(source).body[0].body
    docs = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = trailing.get(node.lineno, "")
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = inspect.cleandoc(nxt.value.value)
        section, j = [], node.lineno - 2
        while j >= 0 and lines[j].strip().startswith("#"):
            section.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        docs[node.target.id] = (section, doc)
    return docs


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _comment(text: str, width: int = 100) -> list[str]:
    out = []
    for i, para in enumerate(text.split("\n\n")):
        out += ["#"] if i else []
        out += ["# " + line for line in textwrap.wrap(" ".join(para.split()), width - 2)] or ["#"]
    return out


def _table_lines(cls, instance, docs) -> tuple[list[str], list[tuple[str, Any]]]:
    lines, nested = [], []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f.name, value))
            continue
        section, doc = docs.get(f.name, ([], ""))
        if section:
            lines += ["", *("# ---- " + s for s in section)]
        lines.append("")
        hint = hints[f.name]
        if type(None) in typing.get_args(hint):
            doc = (doc + " " if doc else "") + "In this file a negative number means None."
        if typing.get_origin(hint) is typing.Literal:
            doc = (doc + " " if doc else "") + "One of: " + ", ".join(map(_toml_value, typing.get_args(hint))) + "."
        lines += _comment(doc or f"(undocumented: see {inspect.getmodule(cls).__name__})")
        lines.append(f"{f.name} = {_toml_value(-1 if value is None else value)}")
    return lines, nested


def example_toml() -> str:
    """An annotated TOML file holding every field at its default."""
    head = [
        "# asyncrl coordinator config: every field at its default, with its documentation.",
        "# Generated from coordinator/config.py by `asyncrl-coordinator example-config`; do not edit by hand.",
        "#",
        "#   asyncrl-coordinator run --config configs/coordinator.example.toml [--flag value ...]",
        "#",
        "# Precedence: defaults < this file < command-line flags. Unknown keys are errors. Relative paths",
        "# (run_dir) are relative to the directory the coordinator is started from. The resolved config is",
        "# written to <run_dir>/config.json at start. The defaults are for a real model; model = \"tiny\"",
        "# brings its toy preset (coordinator/config.py TINY_PRESET) for fields a file or flag leaves unset,",
        "# model = \"smollm2-135m-instruct\" its CPU-sized one (SMOLLM2_PRESET).",
        "# Model presets with their reasons: configs/qwen2.5-*.toml, docs/presets.md.",
    ]
    lines, nested = _table_lines(CoordinatorConfig, CoordinatorConfig(), field_docs(CoordinatorConfig))
    out = head + lines
    for name, value in nested:
        sub_lines, _ = _table_lines(type(value), value, field_docs(type(value)))
        cls_doc = field_docs(CoordinatorConfig).get(name, ([], ""))[1]
        out += ["", "", *(_comment(cls_doc) if cls_doc else []), f"[{name}]", *sub_lines[1:]]
    return "\n".join(out) + "\n"
