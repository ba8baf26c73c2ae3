"""Rewards shared by the coordinator (re-verification) and the client (scoring): one code path.

Rewards are looked up by name in one registry (built-ins, then the `asyncrl.rewards` entry-point group a
third-party package uses, pyproject.toml). Two forms:

  trl      any function TRL's GRPOTrainer accepts, called as GRPOTrainer._calculate_rewards calls it:
           once per group, keyword arguments only — `prompts` (the dataset's prompt repeated G times: a
           string, or a list of messages), `completions` (the G texts; conversational prompts:
           `[{"role": "assistant", "content": text}]` each, a prefilled assistant turn prepended as TRL's
           bootstrap), `completion_ids` (G lists of ints), `trainer_state` (`RewardState`: only
           `global_step`), `log_extra` / `log_metric` (accepted; what they are given is not recorded yet),
           and every other dataset column repeated G times. Returns G floats or None ("not applicable");
           values are not clamped. `async def` functions (anything returning an awaitable) are awaited.
           This is the form of every function that is not declared simple.
  simple   `fn(completion: str, answer: str) -> float`, one completion at a time, clamped into [0, 1], NaN
           counts 0 (`exact`, `math`, `repeat`). Declared explicitly — `@simple_reward`, or an attribute
           `asyncrl_reward_shape = "simple"` on the function — never guessed from the signature.

Not supported: reward *models* (TRL's model-id strings / nn.Module rewards) and `environments`; a function
that needs one, or a keyword nobody passes, or a positional-only parameter, is refused when the task opens
(`check_reward`: the coordinator's start) with a `RewardError` naming the parameter. A function without
`**kwargs` is passed only the keywords it names (TRL would raise there; we are lenient by design).

A **reward spec** names what a record is scored with: one name (`"math"`), or a weighted sum
(`"accuracy+0.5*format"`, TRL's `reward_funcs` + `reward_weights`). Weighted sums follow TRL's
GRPOTrainer exactly: None becomes NaN, the total is `nansum(weight_i * reward_i)`, and a sample for
which *every* reward returned None scores 0 (TRL warns; we count it in `GroupScore.all_none`). A total
that is not finite or beyond `limits.MAX_ABS_REWARD` is an error of the reward, never a training value.

`score_group` is the one function both sides call; `score` keeps the one-completion API.

Size: one contract, TRL's reward functions as users bring them (signatures, conversational records,
async rewards, weighted specs), and the group scorer that applies it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

from asyncrl.protocol import limits

from . import rgym
from .math_reward import Unscorable
from .prompt import Prompt
from .toy import repeat_reward

RewardFn = Callable[..., Any]
SHAPES = ("simple", "trl", "batch")  # "batch": the older name of "trl"
TRL_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""What GRPOTrainer passes every custom reward besides the dataset columns (`environments` only with an
environment_factory, which asyncrl does not have)."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
RESERVED_COLUMNS = ("prompt", "completion", "completions", "prompts", "completion_ids")
"""Column names TRL keeps for itself: a dataset column by one of these names is not passed as a kwarg
(except "prompt", which becomes `prompts`)."""


def simple_reward(fn: RewardFn) -> RewardFn:
    """Declare `fn` a simple `(completion, answer) -> float` reward (see the module docstring)."""
    fn.asyncrl_reward_shape = "simple"
    return fn


def trl_reward(fn: RewardFn) -> RewardFn:
    """Declare `fn` a TRL-form reward (the default for any function not declared simple)."""
    fn.asyncrl_reward_shape = "trl"
    return fn


batch_reward = trl_reward  # the older name


@simple_reward
def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def gold_answer(answer: str) -> str:
    """The reference a math answer is checked against: GSM8K's worked solutions end in `#### N`, so
    the text after the last `####` (thousands commas dropped); anything else (a bare number, LaTeX,
    `\\boxed{...}`) as it is."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer


@simple_reward
def math_reward(completion: str, answer: str) -> float:
    """math-verify equivalence of the completion's final answer and the gold answer (GSM8K `#### N`,
    `\\boxed{}` or plain), in a time-limited worker."""
    from .math_reward import math_reward as verify

    return verify(completion, gold_answer(answer))


REWARDS: dict[str, RewardFn] = {"repeat": simple_reward(repeat_reward), "exact": exact_reward, "math": math_reward,
                                 rgym.REWARD: rgym.reasoning_gym_reward}
BUILTIN = frozenset(REWARDS)


# ---- scoring without decoding, where a reward allows it (the coordinator's re-scoring: coordinator/ingest/) ----

def printable_count(text: str) -> int:
    """Printable ASCII characters (! .. ~) in `text`: never whitespace, never merged away by decoding."""
    return sum(1 for ch in text if "!" <= ch <= "~")


class PrintableTable:
    """For each token id, a lower bound on the printable ASCII characters it adds to *any* decoded sequence
    (its text decoded alone; special tokens 0). Summing it over a completion's ids bounds the decoded
    text's printable count from below without decoding — about 1 us per 512 tokens against ~220 us for
    HF `decode` of a 151,936-token vocabulary (bench/ingest.py).

    Why it is a lower bound: a decoder joins tokens' texts (byte-level BPE joins bytes, SentencePiece maps
    the word marker to a space, byte-fallback tokens join into characters) and only spaces, markers or
    invalid UTF-8 bytes change at the joins; a printable ASCII byte is a whole character in UTF-8 and stays.
    Not trusted blindly: the constructor decodes `check` random sequences and keeps the table only if the
    bound held for every one (`self.table` is None otherwise, and nothing is skipped)."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *, check: int = 256, seed: int = 0):
        import numpy as np

        n = len(tokenizer)
        size = max(n, vocab_size or 0)
        ids = [[i] for i in range(n)]
        fast = getattr(tokenizer, "_tokenizer", None)
        texts = (fast.decode_batch(ids, skip_special_tokens=True) if fast is not None
                 else [tokenizer.decode(i, skip_special_tokens=True) for i in ids])
        table = np.zeros(size, dtype=np.int32)
        table[:n] = [printable_count(t) for t in texts]
        for special in getattr(tokenizer, "all_special_ids", ()):
            if 0 <= special < size:
                table[special] = 0
        rng = np.random.default_rng(seed)
        self.table = table
        self.problem = None
        for _ in range(check):
            seq = rng.integers(0, n, size=int(rng.integers(1, 257))).tolist()
            text = tokenizer.decode(seq, skip_special_tokens=True)
            if int(table[seq].sum()) > printable_count(text):
                self.table, self.problem = None, f"bound broken by the sequence {seq[:16]}..."
                break

    def lower_bound(self, ids) -> int:
        return int(self.table[ids].sum())

    def lower_bounds(self, arrays) -> list[int]:
        """`lower_bound` of each id array, in one pass over all of them."""
        import numpy as np

        lengths = [len(a) for a in arrays]
        if not arrays or not sum(lengths):
            return [0] * len(arrays)
        counts = self.table.take(np.concatenate(arrays))
        ends = np.cumsum(lengths)
        totals = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        return (totals[ends] - totals[ends - np.asarray(lengths)]).tolist()


def impossible(reward: str, printable_lower_bound: int, answer: str) -> bool:
    """True only when `reward` must be 0 for any completion with at least that many printable characters:
    `exact` needs the stripped completion to equal the stripped answer, so it has exactly the answer's count."""
    return reward == "exact" and printable_lower_bound > _answer_printables(answer)


@functools.lru_cache(maxsize=4096)
def _answer_printables(answer: str) -> int:
    return printable_count(answer.strip())


class UnknownReward(KeyError):
    pass


class RewardError(ValueError):
    """A reward function or spec that cannot be used: a bad spec, an unknown shape, a wrong return value."""


def get_reward(name: str) -> RewardFn:
    """Built-in rewards, then third-party ones from the `asyncrl.rewards` entry-point group."""
    if name in REWARDS:
        return REWARDS[name]
    from importlib.metadata import entry_points

    for ep in entry_points(group="asyncrl.rewards"):
        if ep.name == name:
            fn = ep.load()
            REWARDS[name] = fn
            return fn
    raise UnknownReward(f"unknown reward {name!r}; built-in: {sorted(REWARDS)}")


def reward_package(name: str) -> tuple[str, str] | None:
    """(distribution name, version) of the package an entry-point reward comes from; None for a built-in
    (it ships with asyncrl) or a reward registered in code."""
    if name in BUILTIN:
        return None
    from importlib.metadata import entry_points

    for ep in entry_points(group="asyncrl.rewards"):
        if ep.name == name and ep.dist is not None:
            return ep.dist.name, ep.dist.version
    return None


def packages_of(specs) -> list[tuple[str, str, str]]:
    """(reward, distribution, version) for every entry-point reward the reward `specs` name, sorted: what a
    volunteer must have installed to score this task (tasks/rewards.py; the coordinator's handshake)."""
    out = set()
    for spec in specs:
        for term in parse_spec(spec):
            pkg = reward_package(term.name)
            if pkg is not None:
                out.add((term.name, *pkg))
    return sorted(out)


def reward_shape(fn: RewardFn) -> str:
    """"trl" or "simple" (see the module docstring): the declared shape, else "trl"."""
    mark = getattr(fn, "asyncrl_reward_shape", None)
    if mark is None:
        return "trl"
    if mark not in SHAPES:
        raise RewardError(f"asyncrl_reward_shape must be one of {SHAPES[:2]}, got {mark!r}")
    return "trl" if mark == "batch" else mark


def check_reward(name: str, fn: RewardFn, columns=None) -> str:
    """The reward's shape, or a RewardError naming what asyncrl cannot call it with. `columns`: the dataset
    columns a record passes (None: not known here, only the signature's own problems are checked)."""
    torch = sys.modules.get("torch")  # a torch module exists only once torch is imported: checking costs no import
    if torch is not None and isinstance(fn, torch.nn.Module):
        raise RewardError(f"reward {name!r} is a model: reward models are not supported (only functions)")
    if isinstance(fn, str) or not callable(fn):
        raise RewardError(f"reward {name!r} is not a function ({type(fn).__name__}): reward models named by id "
                          "are not supported")
    shape = reward_shape(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return shape  # a builtin without a signature: its own errors show when it is called
    params = sig.parameters.values()
    if shape == "simple":
        try:
            sig.bind("completion", "answer")
        except TypeError as exc:
            raise RewardError(f"simple reward {name!r} cannot be called as fn(completion, answer): {exc}") from None
        return shape
    given = set(TRL_KWARGS) | (set(columns) - set(RESERVED_COLUMNS) if columns is not None else set())
    for p in params:
        required = p.default is inspect.Parameter.empty
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            raise RewardError(f"reward {name!r}: parameter {p.name!r} is positional-only; TRL-form rewards are "
                              "called with keyword arguments only")
        if p.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) or not required:
            continue
        if p.name == "environments":
            raise RewardError(f"reward {name!r}: parameter 'environments' is not supported (asyncrl has no "
                              "environment_factory)")
        if columns is not None and p.name not in given:
            hint = (" — a simple (completion, answer) reward must be declared: @asyncrl.tasks.simple_reward or "
                    "asyncrl_reward_shape = \"simple\"" if p.name in ("completion", "answer") else "")
            raise RewardError(f"reward {name!r}: parameter {p.name!r} is neither one TRL passes "
                              f"({', '.join(TRL_KWARGS)}) nor a column of the record "
                              f"({', '.join(sorted(given - set(TRL_KWARGS))) or 'none'}){hint}")
    return shape


# ---- reward specs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardTerm:
    name: str
    weight: float = 1.0


def parse_spec(spec: str) -> tuple[RewardTerm, ...]:
    """`"math"` or `"accuracy+0.5*format"` -> terms; raises RewardError on bad syntax (names unchecked)."""
    if not isinstance(spec, str) or not spec:
        raise RewardError("a reward spec must be a non-empty string")
    terms = []
    for part in spec.split("+"):
        weight_text, star, name = part.rpartition("*")
        weight = 1.0
        if star:
            try:
                weight = float(weight_text)
            except ValueError:
                raise RewardError(f"reward spec {spec!r}: {weight_text!r} is not a weight") from None
        if not math.isfinite(weight):
            raise RewardError(f"reward spec {spec!r}: weights must be finite")
        if not _NAME.match(name):
            raise RewardError(f"reward spec {spec!r}: {name!r} is not a reward name")
        terms.append(RewardTerm(name, weight))
    if len({t.name for t in terms}) != len(terms):
        raise RewardError(f"reward spec {spec!r} names a reward twice")
    return tuple(terms)


def format_spec(names, weights=None) -> str:
    """The canonical spec for reward names (a string or a list) and optional weights (TRL's
    `reward_weights`: one per name, default 1.0 each)."""
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise RewardError("at least one reward is needed")
    weights = [1.0] * len(names) if weights is None else [float(w) for w in weights]
    if len(weights) != len(names):
        raise RewardError(f"{len(weights)} reward_weights for {len(names)} rewards: give one weight per reward")
    spec = "+".join(n if w == 1.0 else f"{w!r}*{n}" for n, w in zip(names, weights))
    parse_spec(spec)  # names and weights valid, no duplicates
    return spec


def check_spec(spec: str, columns=None) -> str:
    """Parse and resolve every name and check each function can be called with the record's `columns`
    (`check_reward`; UnknownReward / RewardError); returns the canonical form."""
    terms = parse_spec(spec)
    for t in terms:
        check_reward(t.name, get_reward(t.name), columns)
    return format_spec([t.name for t in terms], [t.weight for t in terms])


# ---- scoring --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupScore:
    rewards: list[float]   # the total per completion: what a Completion claims and the learner trains on
    per_reward: dict[str, list[float | None]]  # each reward's own values (None = not applicable)
    all_none: int          # completions for which every reward said None (their total is 0, as in TRL)


def _clamped(value) -> float:
    value = float(value)
    if value != value:  # NaN
        return 0.0
    return min(1.0, max(0.0, value))


def record_view(prompt: Prompt) -> tuple[Any, dict[str, Any]]:
    """(the dataset's prompt, the other columns) as reward functions see them."""
    if not prompt.columns:
        return prompt.text, {"answer": prompt.answer}
    cols = json.loads(prompt.columns)
    original = cols.pop("prompt", prompt.text)
    return original, {k: v for k, v in cols.items() if k not in RESERVED_COLUMNS}


def is_conversational(prompt_value) -> bool:
    """TRL's test: a prompt that is a list of {"role", "content"} messages."""
    return (isinstance(prompt_value, list) and bool(prompt_value) and isinstance(prompt_value[0], dict)
            and "role" in prompt_value[0] and "content" in prompt_value[0])


@dataclass(frozen=True)
class RewardState:
    """What a TRL-form reward gets as `trainer_state`: the same on the volunteer and on the coordinator's
    re-score, so only what both know. `global_step` is the adapter version the completions were sampled
    with (= optimizer steps taken when publish_every is 1). Any other TrainerState attribute is an
    AttributeError that says so."""

    global_step: int = 0

    def __getattr__(self, item):
        raise AttributeError(f"asyncrl's trainer_state has only global_step (the adapter version sampled "
                             f"with); TrainerState.{item} is not available")


def _discard(*args, **kwargs) -> None:
    """log_extra / log_metric: accepted so TRL's functions run unchanged; what they log is not recorded."""


def _await(value):
    """The result of an awaitable (an async reward), run to completion on a loop of its own."""
    async def wait():
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # called from inside a running loop: a fresh loop in a helper thread
        return pool.submit(asyncio.run, wait()).result()


def _batch_values(name: str, fn: RewardFn, prompt_value, texts: list[str], completion_ids, columns,
                  version: int = 0) -> list:
    g = len(texts)
    if is_conversational(prompt_value):
        last = prompt_value[-1]
        bootstrap = last["content"] if last.get("role") == "assistant" else ""  # TRL: a prefilled assistant turn
        completions = [[{"role": "assistant", "content": bootstrap + t}] for t in texts]
    else:
        completions = list(texts)
    kwargs = {k: [v] * g for k, v in columns.items()}
    kwargs.update(prompts=[prompt_value] * g, completions=completions,
                  completion_ids=[list(ids) for ids in completion_ids], trainer_state=RewardState(int(version)),
                  log_extra=_discard, log_metric=_discard)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}  # no **kwargs: pass what it names
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        out = _await(out)
    try:
        values = list(out)
    except TypeError:
        raise RewardError(f"reward {name!r} returned {type(out).__name__}, not a list of floats") from None
    if len(values) != g:
        raise RewardError(f"reward {name!r} returned {len(values)} values for {g} completions")
    clean = []
    for v in values:
        if v is None:
            clean.append(None)
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            f = float(v)  # int, bool, numpy and torch scalars
        except (TypeError, ValueError):
            raise RewardError(f"reward {name!r} returned {type(v).__name__}; expected float or None") from None
        if f != f:
            clean.append(None)  # NaN: TRL's nansum skips it exactly as it skips None
        elif not math.isfinite(f):
            raise RewardError(f"reward {name!r} returned {f}")
        else:
            clean.append(f)
    return clean


def score_group(prompt: Prompt, texts: list[str], completion_ids, version: int = 0) -> GroupScore:
    """Score one group's completions (decoded with skip_special_tokens) with `prompt.reward`; `version` is
    the adapter version they were sampled with (TRL-form rewards see it as `trainer_state.global_step`).

    Both the volunteer (before it signs) and the coordinator (re-scoring at ingest) call exactly this.
    """
    terms = parse_spec(prompt.reward)
    g = len(texts)
    prompt_value, columns = record_view(prompt)
    per_reward: dict[str, list[float | None]] = {}
    totals = [0.0] * g
    seen = [False] * g
    for term in terms:
        fn = get_reward(term.name)
        if reward_shape(fn) == "simple":
            values: list[float | None] = [_clamped(fn(t, prompt.answer)) for t in texts]
        else:
            values = _batch_values(term.name, fn, prompt_value, texts, completion_ids, columns, version)
        per_reward[term.name] = values
        for i, v in enumerate(values):
            if v is not None:
                totals[i] += term.weight * v
                seen[i] = True
    for t in totals:
        if not math.isfinite(t) or abs(t) > limits.MAX_ABS_REWARD:
            raise RewardError(f"reward {prompt.reward!r} total {t} is outside ±{limits.MAX_ABS_REWARD:g}")
    return GroupScore(rewards=totals, per_reward=per_reward, all_none=seen.count(False))


def score(reward: str, completion: str, answer: str) -> float:
    """One completion, no dataset columns: `score_group` for a group of one (simple rewards: clamped to [0, 1]).

    A reward that cannot finish — a timeout, a crash, a bug in a plugin, a wrong return value — raises
    `Unscorable`, never a made-up score: the coordinator then drops the group without blaming the
    volunteer (docs/SECURITY.md). An unknown reward name stays `UnknownReward` (a configuration error)."""
    try:
        return score_group(Prompt("", "", answer, reward), [completion], [[]]).rewards[0]
    except (Unscorable, UnknownReward):
        raise
    except Exception as exc:
        raise Unscorable(f"reward {reward!r} failed: {exc.__class__.__name__}: {str(exc)[:200]}") from None
