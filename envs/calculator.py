"""`calculator`: arithmetic word problems with one tool, `calculate(expression)`.

Record (JSONL, one per line): {"question": "What is 17 * 23 + 4?", "answer": "395"}. The model may call the
tool (Qwen/Hermes `<tool_call>` blocks, envs/tools.py) as often as `limits.max_turns` allows; the first turn
without a tool call is its final answer, rewarded 1.0 when the last number in it equals the record's answer
(numerically), else 0.0. The tool evaluates + - * / // % ** and parentheses on numbers only (an AST walk,
never `eval`), with bounded exponents and lengths, so the same expression gives the same text everywhere.
"""

from __future__ import annotations

import ast
import operator
import re

from .base import EnvLimits, Reset, StepResult
from .tools import parse_tool_calls, run_tool_calls, tool

SYSTEM = ("You are a careful calculator. Use the calculate tool for arithmetic, then give the final answer "
          "as a number.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError("exponent too large")
        value = _OPS[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. 12*(3+4)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError("expression too long")
    value = _eval(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return repr(round(value, 6)) if isinstance(value, float) else str(value)


def same_number(text: str, answer: str) -> bool:
    """The last number written in `text` equals `answer` (both read as numbers, thousands commas dropped)."""
    found = _NUMBER.findall(text.replace(",", ""))
    try:
        return bool(found) and abs(float(found[-1]) - float(answer.replace(",", ""))) < 1e-6
    except ValueError:
        return False


class CalculatorEnv:
    name = "calculator"
    limits = EnvLimits(max_turns=4, max_env_tokens=256, max_total_tokens=768, step_timeout_s=5.0)
    tools = {"calculate": tool(calculate)}

    def reset(self, record: dict, seed: int) -> Reset:
        state = {"answer": str(record["answer"]), "final": ""}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(record["question"])}]
        return Reset(messages, state, tools=[t.schema for t in self.tools.values()])

    def step(self, state: dict, assistant: str) -> StepResult:
        calls = parse_tool_calls(assistant)
        if not calls:
            state["final"] = assistant
            return StepResult([], done=True)
        return StepResult(run_tool_calls(calls, self.tools), done=False)

    def final_reward(self, state: dict) -> float:
        return 1.0 if state["final"] and same_number(state["final"], state["answer"]) else 0.0
