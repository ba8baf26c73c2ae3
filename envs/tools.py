"""Tools as plain Python functions with a JSON schema, and tool calls in the Qwen/Hermes convention.

The model calls a tool by writing, anywhere in its turn,

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "12*7"}}
    </tool_call>

(the format Qwen2.5/Qwen3 and Hermes chat templates teach, and vLLM's `hermes` tool parser reads). Each call
is answered by one message {"role": "tool", "content": <result>}; the chat template wraps it (Qwen: a user
turn holding `<tool_response>...</tool_response>`). Parsing is a pure function of the text, so the volunteer
and the coordinator's replay read the same calls from the same turn.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
MAX_CALLS_PER_TURN = 8


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Tool:
    fn: Callable[..., Any]
    schema: dict  # OpenAI/Qwen function schema: {"type": "function", "function": {name, description, parameters}}

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def tool(fn: Callable[..., Any], description: str | None = None) -> Tool:
    """A `Tool` whose schema is read from `fn`'s signature (int/float/str/bool parameters; a parameter without
    a default is required) and docstring (its first line is the description)."""
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        kind = _JSON_TYPES.get(p.annotation if not isinstance(p.annotation, str) else
                               {"int": int, "float": float, "str": str, "bool": bool}.get(p.annotation), "string")
        props[p.name] = {"type": kind}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = description or (inspect.getdoc(fn) or fn.__name__).splitlines()[0]
    return Tool(fn, {"type": "function", "function": {"name": fn.__name__, "description": doc,
                                                      "parameters": {"type": "object", "properties": props,
                                                                     "required": required}}})


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """Every `<tool_call>` block of `text`, in order: a ToolCall, or the error string for a block that is not
    {"name": str, "arguments": object} JSON (the environment answers it as the tool result, as a real tool
    runtime would). At most MAX_CALLS_PER_TURN blocks are read."""
    out: list[ToolCall | str] = []
    for block in _CALL.findall(text)[:MAX_CALLS_PER_TURN]:
        try:
            obj = json.loads(block)
        except ValueError:
            out.append("error: tool call is not valid JSON")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append("error: tool call needs a string 'name'")
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            out.append("error: tool call 'arguments' must be an object")
            continue
        out.append(ToolCall(obj["name"], args))
    return out


def run_tool_calls(calls: list[ToolCall | str], tools: dict[str, Tool]) -> list[dict]:
    """One {"role": "tool", "content": str} per call. A tool that raises answers "error: ..." (the model
    sees its mistake); results are str()-ed so the rendering is the same on every machine."""
    out = []
    for call in calls:
        if isinstance(call, str):
            content = call
        elif call.name not in tools:
            content = f"error: unknown tool {call.name!r}"
        else:
            try:
                content = str(tools[call.name].fn(**call.arguments))
            except Exception as exc:  # noqa: BLE001 - the tool's error is the model's feedback
                content = f"error: {type(exc).__name__}: {exc}"
        out.append({"role": "tool", "content": content})
    return out
