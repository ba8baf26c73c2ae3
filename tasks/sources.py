"""Task sources: where the coordinator's prompts come from, resumable by position.

Owned here: parsing a `--task` spec, the three source kinds, record validation, chat templating, the
start-up length check, and the one function both prompt tokenisation sites use (`encode_prompt`: the
coordinator's lease grant and ingest's re-check must produce the same ids, or every batch is refused).

    --task repeat                          built-in toy task (asyncrl.tasks; raw text, never templated)
    --task data/train.jsonl                JSONL, one {"prompt": ..., "answer": ..., "reward"?: ...} per line
    --task jsonl:data/train.jsonl          the same, explicit
    --task hf:openai/gsm8k:main:train      a Hugging Face dataset: hf:<name>[:<config>]:<split> or hf:<name>;
    --task hf:/path/to/saved_dataset       a local directory written by Dataset.save_to_disk (load_from_disk)
    --task reasoning_gym:chain_sum         a reasoning-gym generator; its splits, parameters, prompt and reward:
                                           tasks/rgym.py

Records (`RecordFields`): the prompt field holds a string or, in TRL's conversational format, a list of
{"role", "content"} messages (system prompt included); the answer field a string (numbers become
strings; it may be missing when only TRL-style rewards score the record); an optional "reward" field a
reward spec or a list of reward names (tasks/rewards.py) that wins over the default. Every other column
travels with the prompt (`Prompt.columns`) so TRL-style rewards get it as a keyword argument on both
sides. Records are validated when the source opens, so a bad file fails at start-up with its line
number (`TaskSourceError`), never halfway through a run.

Length check (`check_records`): each prompt, as tokenised for the lease, must leave `max_new_tokens` of
the model's context (`max_prompt_tokens`), and its columns must fit the lease (limits.py); an oversized
record stops the start naming it (`oversized="error"`) or is skipped and counted (`"skip"`, `report`).

Resumability: every source is an iterator whose whole position is one integer (`state()` / `restore()`),
so a checkpoint stores `{"index": n}`, not the data. Dataset sources walk the records in a seeded
shuffled order per epoch and never run dry; prompt ids (`<name>-<n>`) are unique across epochs, which
the task board and the exactly-once bookkeeping rely on.

Chat templates (`chat_template`: "auto" | "on" | "off"): with "auto" a dataset prompt goes through the
tokenizer's template when it has one — a conversational prompt as its messages, a plain one as one user
turn (after `system_prompt`, when set) — with the generation prompt added (a prompt ending in an assistant
turn is continued instead, as TRL does). A conversational prompt without a template is an error. The
templated *text* is what the lease carries, so re-tokenising it anywhere gives the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from asyncrl.protocol import limits

from . import rewards, rgym, toy
from .prompt import Prompt

CHAT_TEMPLATE_MODES = ("auto", "on", "off")
Where = tuple[str, "int | None"]  # ("path:line" or "dataset[row]", the JSONL line number)
OVERSIZED_MODES = ("error", "skip")


class TaskSourceError(ValueError):
    """A task spec or data file that cannot be used; `where` is "path:line" (or "dataset[row]") when a
    record is at fault, `line` its 1-based line number in a JSONL file."""

    def __init__(self, message: str, *, where: str | None = None, line: int | None = None):
        super().__init__(message)
        self.where, self.line = where, line


class TaskSource:
    """An endless, resumable prompt iterator. Subclasses implement `_prompt(index)`."""

    name = "source"
    report: "SourceReport | None" = None  # dataset sources: what opening them found (check_records)

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
        return dataclasses.replace(self.records[self._order[pos]], prompt_id=f"{self.name}-{index}")


@dataclass(frozen=True)
class RecordFields:
    """How dataset records map onto prompts: field names, the default reward spec, a system prompt."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    default_reward: str = "exact"
    system_prompt: str = ""


def _messages_problem(value) -> str | None:
    if not value:
        return "a conversational prompt needs at least one message"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            return f"message {i} needs a non-empty string 'role'"
        if not isinstance(m.get("content"), str):
            return f"message {i} needs a string 'content' (text only)"
    if value[-1]["role"] == "system":
        return "the last message is a system message: nothing to answer"
    return None


def _record(obj, where: str, fields: RecordFields, line: int | None = None) -> Prompt:
    def bad(why: str) -> TaskSourceError:
        return TaskSourceError(f"{where}: {why}", where=where, line=line)

    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    prompt, answer = obj.get(fields.prompt_field), obj.get(fields.answer_field)
    if isinstance(prompt, list):  # TRL's conversational format: [{"role": ..., "content": ...}, ...]
        problem = _messages_problem(prompt)
        if problem:
            raise bad(f"field {fields.prompt_field!r}: {problem}")
    elif not isinstance(prompt, str) or not prompt:
        raise bad(f"field {fields.prompt_field!r} must be a non-empty string or a list of messages")
    reward = obj.get("reward", fields.default_reward)
    try:
        if isinstance(reward, list) and all(isinstance(r, str) for r in reward):
            reward = rewards.format_spec(reward)
        if not isinstance(reward, str):
            raise rewards.RewardError("field 'reward' must name a reward function (or a list of names)")
        reward = rewards.check_spec(reward, columns=[k for k in obj if k != fields.prompt_field])
    except (rewards.UnknownReward, rewards.RewardError) as exc:
        raise bad(exc.args[0]) from None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is None and all(rewards.reward_shape(rewards.get_reward(t.name)) == "trl"
                              for t in rewards.parse_spec(reward)):
        answer = ""  # only TRL-style rewards: they read whatever columns they name
    if not isinstance(answer, str):
        raise bad(f"field {fields.answer_field!r} must be a string")
    columns = {k: v for k, v in obj.items() if k not in (fields.prompt_field, "reward")}
    columns["prompt"] = prompt
    try:
        text = json.dumps(columns, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise bad(f"a column is not plain JSON data ({exc})") from None
    return Prompt(prompt_id="", text=prompt if isinstance(prompt, str) else "", answer=answer, reward=reward,
                  columns=text)


def read_jsonl(path: Path, fields: RecordFields = RecordFields()) -> tuple[list[Prompt], list[Where]]:
    """Validated records of a JSONL file and where each is (`path:line`, line); blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise TaskSourceError(f"task file {path} does not exist")
    out, where = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskSourceError(f"{path}:{lineno}: not valid JSON ({exc.msg})", where=f"{path}:{lineno}",
                                      line=lineno) from None
            out.append(_record(obj, f"{path}:{lineno}", fields, line=lineno))
            where.append((f"{path}:{lineno}", lineno))
    return out, where


def read_hf(spec: str, fields: RecordFields = RecordFields()) -> tuple[list[Prompt], list[Where]]:
    """`name[:config]:split`, `name`, or a local `save_to_disk` directory (optionally `dir:split`)."""
    try:
        import datasets
    except ImportError:
        raise TaskSourceError("hf: task sources need the `datasets` package (pip install 'datasets>=2.18')") from None
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
    if fields.prompt_field not in ds.column_names:
        raise TaskSourceError(f"dataset {spec!r} has no column {fields.prompt_field!r}; columns: {ds.column_names} "
                              "(set --task-prompt-field / --task-answer-field)")
    where = [(f"{spec}[{i}]", None) for i in range(len(ds))]
    return [_record(row, w, fields) for row, (w, _) in zip(ds, where)], where


def templated(records: list[Prompt], tokenizer, system_prompt: str = "") -> list[Prompt]:
    """Each prompt through the tokenizer's chat template: a conversational record as its messages, a plain
    one as a user turn (after `system_prompt` as a system turn, when set). The generation prompt is added,
    except after a prefilled assistant turn, which the model continues (TRL's `continue_final_message`)."""
    out = []
    for r in records:
        original = rewards.record_view(r)[0]
        if isinstance(original, list):
            messages = original
        else:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": original}]
        prefill = messages[-1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefill,
                                             continue_final_message=prefill)
        out.append(dataclasses.replace(r, text=text))
    return out


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids, the one way both the lease and ingest compute them.

    A templated prompt already starts with the BOS text where the template wants one; adding special
    tokens again would give a double BOS, so they are added only when the text does not start with it.
    """
    return encode_prompts(tokenizer, [text])[0]


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """`encode_prompt` for many texts at once (the fast tokenizer's batch path; same ids)."""
    bos = getattr(tokenizer, "bos_token", None)
    out: list[list[int] | None] = [None] * len(texts)
    for add in (True, False):
        idx = [i for i, t in enumerate(texts) if (not (bos and t.startswith(bos))) == add]
        for lo in range(0, len(idx), 1024):
            chunk = idx[lo:lo + 1024]
            ids = tokenizer([texts[i] for i in chunk], add_special_tokens=add)["input_ids"]
            for i, row in zip(chunk, ids):
                out[i] = list(row)
    return out  # type: ignore[return-value]


@dataclass
class SourceReport:
    """What opening a dataset source found: record count, the longest prompt, what was skipped and why."""

    records: int = 0
    longest_prompt_tokens: int = 0
    longest_text_bytes: int = 0     # UTF-8, the (templated) prompt text a lease carries
    longest_columns_bytes: int = 0  # UTF-8, the columns JSON a lease carries (the answer is inside it)
    skipped_long: int = 0
    skipped_columns: int = 0
    held_out: int = 0  # reasoning_gym: train problems left out because the evaluation split has them
    examples: list[str] = dataclasses.field(default_factory=list)  # first few skipped records, "where: why"

    @property
    def skipped(self) -> int:
        return self.skipped_long + self.skipped_columns


def check_records(records: list[Prompt], where: list[Where], tokenizer, *, max_prompt_tokens: int | None,
                  oversized: str) -> tuple[list[Prompt], SourceReport]:
    """Refuse (`oversized="error"`) or drop and count (`"skip"`) records whose prompt has more than
    `max_prompt_tokens` tokens (the model's context minus max_new_tokens) or whose columns exceed the
    lease's bound (limits.MAX_TASK_COLUMNS_CHARS)."""
    if oversized not in OVERSIZED_MODES:
        raise TaskSourceError(f"oversized_records must be one of {OVERSIZED_MODES}")
    lengths = encode_prompts(tokenizer, [r.text for r in records]) if tokenizer is not None else None
    report, kept = SourceReport(), []
    for i, r in enumerate(records):
        n = len(lengths[i]) if lengths is not None else 0
        why = None
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            why, kind = (f"prompt is {n} tokens; the model's context leaves {max_prompt_tokens} for it after "
                         "max_new_tokens"), "skipped_long"
        elif len(r.columns) > limits.MAX_TASK_COLUMNS_CHARS:
            why, kind = (f"record is {len(r.columns)} characters as JSON; a lease carries at most "
                         f"{limits.MAX_TASK_COLUMNS_CHARS}"), "skipped_columns"
        if why is None:
            kept.append(r)
            report.longest_prompt_tokens = max(report.longest_prompt_tokens, n)
            report.longest_text_bytes = max(report.longest_text_bytes, len(r.text.encode()))
            report.longest_columns_bytes = max(report.longest_columns_bytes, len(r.columns.encode()))
            continue
        if oversized == "error":
            raise TaskSourceError(f"{where[i][0]}: {why} (shorten it, raise the limit, or set "
                                  "oversized_records = \"skip\")", where=where[i][0], line=where[i][1])
        setattr(report, kind, getattr(report, kind) + 1)
        if len(report.examples) < 5:
            report.examples.append(f"{where[i][0]}: {why}")
    report.records = len(kept)
    return kept, report


def read_reasoning_gym(spec: str, opts: rgym.SplitOptions, split: str) -> tuple[list[Prompt], list[Where], int]:
    """A reasoning-gym split as validated records (tasks/rgym.py), and how many train problems were held out
    because the evaluation split has them."""
    dataset = rgym.dataset_name(spec)
    try:
        opts = opts.resolved()
        train, evals, held = rgym.splits(dataset, opts)
    except (ImportError, ValueError) as exc:  # no reasoning-gym, bad parameters, SPLIT_OVERLAP
        raise TaskSourceError(str(exc)) from None
    entries = train if split == "train" else evals
    fields = RecordFields(default_reward=rgym.REWARD)
    where = [(f"{spec}[{split} {i}]", None) for i in range(len(entries))]
    return [_record(rgym.record(e, dataset, opts), w, fields) for e, (w, _) in zip(entries, where)], where, held


def open_source(spec: str, *, seed: int = 0, tokenizer=None, chat_template: str = "auto",
                prompt_field: str = "prompt", answer_field: str = "answer", default_reward: str = "exact",
                system_prompt: str = "", max_prompt_tokens: int | None = None,
                oversized: str = "error", generator: rgym.SplitOptions | None = None,
                split: str = "train") -> TaskSource:
    """Parse a `--task` spec (see the module docstring) into a resumable source. Dataset sources are checked
    whole before this returns (`check_records`); their `report` says what was found and skipped.
    `generator` and `split` apply to reasoning_gym: tasks (the "eval" split is walked in generation order)."""
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise TaskSourceError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}")
    try:
        default_reward = rewards.check_spec(default_reward)
    except (rewards.UnknownReward, rewards.RewardError) as exc:
        raise TaskSourceError(f"task_reward: {exc.args[0]}") from None
    fields = RecordFields(prompt_field=prompt_field, answer_field=answer_field, default_reward=default_reward,
                          system_prompt=system_prompt)
    if spec in toy.TASKS:
        return BuiltinSource(spec, seed)
    held = None
    if spec.startswith(rgym.PREFIX):
        records, where, held = read_reasoning_gym(spec, generator or rgym.SplitOptions(), split)
        name = "rg_" + rgym.dataset_name(spec) + ("" if split == "train" else "_eval")
        try:
            system_prompt = rgym.system_prompt(system_prompt)
        except ValueError as exc:
            raise TaskSourceError(str(exc)) from None
    elif spec.startswith("hf:"):
        (records, where), name = read_hf(spec[3:], fields), "hf"
    elif spec.startswith("jsonl:") or spec.endswith(".jsonl"):
        path = Path(spec[6:] if spec.startswith("jsonl:") else spec)
        (records, where), name = read_jsonl(path, fields), path.stem
    else:
        raise TaskSourceError(f"unknown task {spec!r}: use a built-in task {sorted(toy.TASKS)}, "
                              "a .jsonl file (or jsonl:PATH), hf:<dataset>[:config][:split] or "
                              "reasoning_gym:<dataset>")
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has_template:
        raise TaskSourceError("chat_template='on' but the tokenizer has no chat template")
    if chat_template == "on" or (chat_template == "auto" and has_template):
        records = templated(records, tokenizer, system_prompt)
    else:
        chat = next((i for i, r in enumerate(records) if not r.text), None)  # conversational: no text without a template
        if chat is not None:
            why = ("chat_template is 'off'" if chat_template == "off" else "the tokenizer has no chat template")
            raise TaskSourceError(f"{where[chat][0]}: a conversational prompt (a list of messages) needs a chat "
                                  f"template, but {why}", where=where[chat][0], line=where[chat][1])
        if system_prompt and held is not None:  # reasoning-gym's instructions, as plain text before the question
            records = [dataclasses.replace(r, text=f"{system_prompt}\n\n{r.text}\n") for r in records]
        elif system_prompt:
            raise TaskSourceError(f"system_prompt needs a chat template, but {'chat_template is off' if chat_template == 'off' else 'the tokenizer has none'}")
    records, report = check_records(records, where, tokenizer, max_prompt_tokens=max_prompt_tokens,
                                    oversized=oversized)
    if not records:
        raise TaskSourceError(f"task source {spec!r}: every record was skipped ({report.examples[:1]})")
    name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:40] or "task"
    source = RecordsSource(name, records, seed, shuffle=split == "train")
    source.report = report
    report.held_out = held or 0
    return source
