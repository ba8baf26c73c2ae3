"""reasoning-gym as a task source: `--task reasoning_gym:<dataset>` (docs/tasks.md).

Owned here: generating a dataset's train and evaluation splits from (dataset, generator parameters, size,
seed), keeping them apart, turning entries into task records, reasoning-gym's system prompts, and the
`reasoning_gym` reward, which both the volunteer and the coordinator's re-scoring call (tasks/rewards.py).

Determinism: a reasoning-gym entry `i` of a dataset with seed `s` is drawn from `random.Random(s + i)`, so
(dataset, params, size, seed) regenerate the same problems anywhere, and two splits share an RNG stream
exactly when their seed ranges [s, s + size) intersect. The splits therefore must use disjoint seed ranges
(`SplitOptions.check` refuses others), and since two different RNG states can still draw the same problem
(a small space: two-term sums repeat), every train entry whose question text is in the evaluation split is
left out of training (`held_out`). `check_disjoint` is the final word wherever a split is scored: an
evaluation problem whose question is in the training split is refused (SPLIT_OVERLAP).

Records carry the entry (answer, metadata) plus the dataset name, its parameters and the extractor as
columns, so the reward rebuilds the dataset's own `score_answer` from the record alone (the lease carries
the columns verbatim) — the same computation on both sides, with no state outside the record.

Answer extraction follows reasoning-gym: the text of the last `<answer>...</answer>` (reasoning_gym.utils
`extract_answer`; "answer_tags", the default), the last number in the completion ("last_number": for a
model too small to follow the tag instruction, whose tag-only reward would be 0 for every sample and so give
GRPO no signal), or the whole stripped completion ("raw"). The prompt gets
reasoning-gym's system prompt ("default" unless `task_system_prompt` names another as
`reasoning_gym:<name>` or gives its own text), which tells a chat model to answer inside the tags.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field

PREFIX = "reasoning_gym:"
REWARD = "reasoning_gym"
EXTRACTORS = ("answer_tags", "last_number", "raw")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
EVAL_SEED_OFFSET = 1_000_000_007  # the evaluation split's default seed: far from any train range


class SplitOverlap(ValueError):
    """Train and evaluation splits share a seed range or a question (stable code SPLIT_OVERLAP)."""

    code = "SPLIT_OVERLAP"


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("reasoning_gym: tasks need the `reasoning-gym` package (pip install 'reasoning-gym>=0.1.19')") from None
    return reasoning_gym


def parse_params(items) -> dict:
    """`("min_terms=2", "op=+")` -> {"min_terms": 2, "op": "+"}: each value as JSON, else as a string."""
    out = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        if not eq or not key.strip():
            raise ValueError(f"task parameter {item!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


@dataclass(frozen=True)
class SplitOptions:
    """What defines a reasoning-gym task's splits (the config's task_params, task_size, task_data_seed,
    task_eval_size, task_eval_seed, task_extractor)."""

    params: tuple[str, ...] = ()
    size: int = 10000
    seed: int = 0
    eval_size: int = 1000
    eval_seed: int | None = None  # None: seed + EVAL_SEED_OFFSET
    extractor: str = "answer_tags"
    generator: dict = field(default_factory=dict, compare=False)  # params parsed (filled by `resolved`)

    def resolved(self) -> SplitOptions:
        eval_seed = self.seed + EVAL_SEED_OFFSET if self.eval_seed is None else self.eval_seed
        opts = SplitOptions(self.params, self.size, self.seed, self.eval_size, eval_seed, self.extractor,
                            parse_params(self.params))
        opts.check()
        return opts

    def check(self) -> None:
        if self.extractor not in EXTRACTORS:
            raise ValueError(f"task_extractor must be one of {EXTRACTORS}, got {self.extractor!r}")
        if self.size < 1 or self.eval_size < 1:
            raise ValueError("task_size and task_eval_size must be at least 1")
        lo, hi = sorted([(self.seed, self.size), (self.eval_seed, self.eval_size)])
        if lo[0] + lo[1] > hi[0]:
            raise SplitOverlap(f"SPLIT_OVERLAP: the train split (seeds {self.seed}..{self.seed + self.size - 1}) and "
                               f"the evaluation split (seeds {self.eval_seed}..{self.eval_seed + self.eval_size - 1}) "
                               "share reasoning-gym seeds, so they would share problems; choose task_eval_seed "
                               "outside the train range")


def dataset_name(spec: str) -> str:
    return spec[len(PREFIX):] if spec.startswith(PREFIX) else spec


def generate(dataset: str, generator: dict, size: int, seed: int) -> list[dict]:
    """`size` entries of `dataset` with these generator parameters, from `seed` (deterministic)."""
    rg = _rg()
    try:
        ds = rg.create_dataset(dataset, size=size, seed=seed, **generator)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning_gym:{dataset}: {exc.__class__.__name__}: {exc}") from None
    return [ds[i] for i in range(size)]


def splits(dataset: str, opts: SplitOptions) -> tuple[list[dict], list[dict], int]:
    """(train entries, evaluation entries, train entries held out because their question is in the
    evaluation split). The evaluation split is `generate(..., eval_size, eval_seed)` unchanged."""
    opts = opts.resolved()
    evals = generate(dataset, opts.generator, opts.eval_size, opts.eval_seed)
    held = {e["question"] for e in evals}
    train_all = generate(dataset, opts.generator, opts.size, opts.seed)
    train = [e for e in train_all if e["question"] not in held]
    if not train:
        raise SplitOverlap(f"SPLIT_OVERLAP: every train problem of reasoning_gym:{dataset} is also in the evaluation "
                           "split (the problem space is too small for these sizes)")
    check_disjoint(train, evals)
    return train, evals, len(train_all) - len(train)


def check_disjoint(train: list[dict], evals: list[dict]) -> None:
    """Refuse (SplitOverlap) when any question text is in both."""
    both = {e["question"] for e in train} & {e["question"] for e in evals}
    if both:
        raise SplitOverlap(f"SPLIT_OVERLAP: {len(both)} evaluation problem(s) are in the training split, e.g. "
                           f"{sorted(both)[0]!r}")


def _plain(value):
    """Metadata as plain JSON data (tuples become lists, anything else its string)."""
    return json.loads(json.dumps(value, default=str))


def record(entry: dict, dataset: str, opts: SplitOptions) -> dict:
    """A task record (sources.py's JSONL shape) for one entry: the question is the prompt; the answer,
    metadata, dataset, generator parameters and extractor travel as columns for the reward."""
    return {"prompt": entry["question"], "answer": str(entry["answer"]), "metadata": _plain(entry.get("metadata", {})),
            "rg_dataset": dataset, "rg_params": _plain(opts.generator), "rg_extractor": opts.extractor,
            "reward": REWARD}


def system_prompt(value: str) -> str:
    """reasoning-gym's system prompt: "" -> its "default"; "reasoning_gym:<name>" -> that one; else `value`."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if not value:
        return SYSTEM_PROMPTS["default"]
    if value.startswith(PREFIX):
        name = value[len(PREFIX):]
        if name not in SYSTEM_PROMPTS:
            raise ValueError(f"no reasoning-gym system prompt {name!r}; it has {sorted(SYSTEM_PROMPTS)}")
        return SYSTEM_PROMPTS[name]
    return value


# ---- the reward: the dataset's own score_answer on the extracted answer ------------------------------
@functools.lru_cache(maxsize=64)
def _scorer(dataset: str, params_json: str):
    rg = _rg()
    return rg.create_dataset(dataset, size=1, seed=0, **json.loads(params_json)).score_answer


def extract(completion: str, extractor: str = "answer_tags") -> str | None:
    if extractor == "raw":
        return completion.strip()
    if extractor == "last_number":
        found = _NUMBER.findall(completion)
        return found[-1].replace(",", "") if found else None
    if extractor != "answer_tags":
        raise ValueError(f"unknown extractor {extractor!r}")
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion)


def score_one(completion: str, *, question: str, answer: str, metadata: dict, dataset: str, params: dict,
              extractor: str = "answer_tags") -> float:
    entry = {"question": question, "answer": answer, "metadata": metadata}
    score = _scorer(dataset, json.dumps(params, sort_keys=True))
    return float(score(extract(completion, extractor), entry))


def reasoning_gym_reward(prompts, completions, answer, metadata, rg_dataset, rg_params, rg_extractor, **_):
    """TRL-shaped batch reward (tasks/rewards.py): each completion scored by the dataset's `score_answer`."""
    out = []
    for prompt, text, ans, meta, ds, params, ex in zip(prompts, completions, answer, metadata, rg_dataset, rg_params,
                                                      rg_extractor):
        if isinstance(text, list):  # conversational completions: the assistant turn's text
            text = text[-1]["content"]
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        out.append(score_one(text, question=question, answer=ans, metadata=meta, dataset=ds, params=params,
                             extractor=ex))
    return out
