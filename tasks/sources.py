"""Task sources: where the coordinator's prompts come from, resumable by position.

Owned here: parsing a `--task` spec, the three source kinds, chat templating, and the one function
both prompt tokenisation sites use (`encode_prompt`: the coordinator's lease grant and ingest's
re-check must produce the same ids, or every batch is refused).

    --task repeat                          built-in toy task (asyncrl.tasks; raw text, never templated)
    --task data/train.jsonl                JSONL, one {"prompt": ..., "answer": ..., "reward"?: ...} per line
    --task jsonl:data/train.jsonl          the same, explicit
    --task hf:openai/gsm8k:main:train      a Hugging Face dataset: hf:<name>[:<config>]:<split> or hf:<name>;
    --task hf:/path/to/saved_dataset       a local directory written by Dataset.save_to_disk (load_from_disk)

Field names (`prompt_field`, `answer_field`) and the default reward (`default_reward`, "exact") are
configurable; a record's own "reward" value wins. Records are validated when the source opens, so a bad
file fails at start-up with its line number (`TaskSourceError`), never halfway through a run.

Resumability: every source is an iterator whose whole position is one integer (`state()` / `restore()`),
so a checkpoint stores `{"index": n}`, not the data. Dataset sources walk the records in a seeded
shuffled order per epoch and never run dry; prompt ids (`<name>-<n>`) are unique across epochs, which
the task board and the exactly-once bookkeeping rely on.

Chat templates (`chat_template`: "auto" | "on" | "off"): with "auto" a dataset prompt is wrapped as one
user turn with the tokenizer's template when the tokenizer has one; the templated *text* is what the
lease carries, so re-tokenising it anywhere gives the same ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

from . import rewards, toy
from .prompt import Prompt

CHAT_TEMPLATE_MODES = ("auto", "on", "off")


class TaskSourceError(ValueError):
    """A task spec or data file that cannot be used; `where` is "path:line" (or "dataset[row]") when a
    record is at fault, `line` its 1-based line number in a JSONL file."""

    def __init__(self, message: str, *, where: str | None = None, line: int | None = None):
        super().__init__(message)
        self.where, self.line = where, line


class TaskSource:
    """An endless, resumable prompt iterator. Subclasses implement `_prompt(index)`."""

    name = "source"

    def __init__(self) -> None:
        self.index = 0

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        prompt = self._prompt(self.index)
        self.index += 1
        return prompt

    def _prompt(self, index: int) -> Prompt:  # pragma: no cover - abstract
        raise NotImplementedError

    def state(self) -> dict:
        return {"kind": self.name, "index": self.index}

    def restore(self, state: dict) -> None:
        if state.get("kind") != self.name:
            raise TaskSourceError(f"checkpoint holds a {state.get('kind')!r} task position, this run uses {self.name!r}")
        self.index = int(state["index"])


class BuiltinSource(TaskSource):
    """A built-in toy task from `asyncrl.tasks`; position = how many prompts were drawn."""

    def __init__(self, task: str, seed: int):
        super().__init__()
        self.name = f"builtin:{task}"
        self._task, self._seed = task, seed
        self._it = toy.get_task(task, seed)

    def _prompt(self, index: int) -> Prompt:
        return next(self._it)

    def restore(self, state: dict) -> None:
        super().restore(state)
        self._it = toy.get_task(self._task, self._seed)  # the toy generators are cheap: fast-forward
        for _ in range(self.index):
            next(self._it)


class RecordsSource(TaskSource):
    """Prompts from in-memory records, shuffled per epoch with a seeded RNG, cycling forever."""

    def __init__(self, name: str, records: list[Prompt], seed: int, shuffle: bool = True):
        super().__init__()
        if not records:
            raise TaskSourceError(f"task source {name!r} holds no records")
        self.name = name
        self.records = records
        self.seed = seed
        self.shuffle = shuffle
        self._order_epoch = -1
        self._order: list[int] = []

    def _prompt(self, index: int) -> Prompt:
        epoch, pos = divmod(index, len(self.records))
        if epoch != self._order_epoch:
            self._order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        rec = self.records[self._order[pos]]
        return Prompt(prompt_id=f"{self.name}-{index}", text=rec.text, answer=rec.answer, reward=rec.reward)


def _record(obj, where: str, prompt_field: str, answer_field: str, default_reward: str,
            line: int | None = None) -> Prompt:
    def bad(why: str) -> TaskSourceError:
        return TaskSourceError(f"{where}: {why}", where=where, line=line)

    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    prompt, answer = obj.get(prompt_field), obj.get(answer_field)
    if not isinstance(prompt, str) or not prompt:
        raise bad(f"field {prompt_field!r} must be a non-empty string")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise bad(f"field {answer_field!r} must be a string")
    reward = obj.get("reward", default_reward)
    if not isinstance(reward, str):
        raise bad("field 'reward' must name a reward function")
    try:
        rewards.get_reward(reward)
    except rewards.UnknownReward as exc:
        raise bad(exc.args[0]) from None
    return Prompt(prompt_id="", text=prompt, answer=answer, reward=reward)


def read_jsonl(path: Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
               default_reward: str = "exact") -> list[Prompt]:
    """Validated records of a JSONL file; blank lines are skipped; errors name `path:line`."""
    path = Path(path)
    if not path.is_file():
        raise TaskSourceError(f"task file {path} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskSourceError(f"{path}:{lineno}: not valid JSON ({exc.msg})", where=f"{path}:{lineno}",
                                      line=lineno) from None
            out.append(_record(obj, f"{path}:{lineno}", prompt_field, answer_field, default_reward, line=lineno))
    return out


def read_hf(spec: str, *, prompt_field: str = "prompt", answer_field: str = "answer",
            default_reward: str = "exact") -> list[Prompt]:
    """`name[:config]:split`, `name`, or a local `save_to_disk` directory (optionally `dir:split`)."""
    try:
        import datasets
    except ImportError:
        raise TaskSourceError("hf: task sources need the `datasets` package (pip install 'asyncrl[hf]')") from None
    name, _, rest = spec.partition(":")
    local = Path(spec) if Path(spec).exists() else (Path(name) if Path(name).exists() else None)
    if local is not None:
        ds = datasets.load_from_disk(str(local))
        split = rest if local == Path(name) else ""
        if isinstance(ds, datasets.DatasetDict):
            if not split:
                split = "train" if "train" in ds else sorted(ds)[0]
            if split not in ds:
                raise TaskSourceError(f"{local}: no split {split!r} (has {sorted(ds)})")
            ds = ds[split]
    else:
        parts = rest.split(":") if rest else []
        config = parts[0] if len(parts) == 2 else None
        split = parts[-1] if parts else "train"
        try:
            ds = datasets.load_dataset(name, config, split=split)
        except Exception as exc:  # network, unknown name, missing config: all fatal at start-up
            raise TaskSourceError(f"cannot load Hugging Face dataset {spec!r}: {exc.__class__.__name__}: {exc}") from None
    missing = [f for f in (prompt_field, answer_field) if f not in ds.column_names]
    if missing:
        raise TaskSourceError(f"dataset {spec!r} has no column(s) {missing}; columns: {ds.column_names} "
                              "(set --task-prompt-field / --task-answer-field)")
    return [_record(row, f"{spec}[{i}]", prompt_field, answer_field, default_reward) for i, row in enumerate(ds)]


def templated(records: list[Prompt], tokenizer) -> list[Prompt]:
    """Wrap each prompt as one user turn with the tokenizer's chat template (generation prompt added)."""
    return [Prompt(prompt_id=r.prompt_id, answer=r.answer, reward=r.reward,
                   text=tokenizer.apply_chat_template([{"role": "user", "content": r.text}], tokenize=False,
                                                      add_generation_prompt=True))
            for r in records]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids, the one way both the lease and ingest compute them.

    A templated prompt already starts with the BOS text where the template wants one; adding special
    tokens again would give a double BOS, so they are added only when the text does not start with it.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add)["input_ids"])


def open_source(spec: str, *, seed: int = 0, tokenizer=None, chat_template: str = "auto",
                prompt_field: str = "prompt", answer_field: str = "answer",
                default_reward: str = "exact") -> TaskSource:
    """Parse a `--task` spec (see the module docstring) into a resumable source."""
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise TaskSourceError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}")
    fields = dict(prompt_field=prompt_field, answer_field=answer_field, default_reward=default_reward)
    if spec in toy.TASKS:
        return BuiltinSource(spec, seed)
    if spec.startswith("hf:"):
        records, name = read_hf(spec[3:], **fields), "hf"
    elif spec.startswith("jsonl:") or spec.endswith(".jsonl"):
        path = Path(spec[6:] if spec.startswith("jsonl:") else spec)
        records, name = read_jsonl(path, **fields), path.stem
    else:
        raise TaskSourceError(f"unknown task {spec!r}: use a built-in task {sorted(toy.TASKS)}, "
                              "a .jsonl file (or jsonl:PATH) or hf:<dataset>[:config][:split]")
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has_template:
        raise TaskSourceError("chat_template='on' but the tokenizer has no chat template")
    if chat_template == "on" or (chat_template == "auto" and has_template):
        records = templated(records, tokenizer)
    name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:40] or "task"
    return RecordsSource(name, records, seed)
