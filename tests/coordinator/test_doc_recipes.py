"""Every coordinator config in the guides starts as written: parsed and resolved exactly as `run --config`
does, then its task opened through the coordinator's own start-up path (coordinator/leasing/preflight.py
`open_task`). Only what cannot exist offline is replaced: a hub dataset by a local JSONL the test writes in
that dataset's format, the hub model by Qwen's real tokenizer and chat template (tests/realshape.py, fetched by
`make`) with a model config of Qwen2.5-0.5B's context, built in code."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from asyncrl import tasks
from asyncrl.coordinator.config_file import resolve_config
from asyncrl.coordinator.leasing import preflight

from tests.realshape import build_config, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
GUIDES = ("docs/researcher.md", "docs/operator.md", "docs/gpu-swarm.md")

# Three rows in openai/gsm8k's format: `question`, and `answer` = worked solution ending in "#### N".
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to "
                 "friends in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "A factory makes 600 toys a day. How many toys does it make in 2 days?",
     "answer": "600 * 2 = <<600*2=1200>>1200\n#### 1,200"},
]
GOLD = {"72", "10", "1200"}


def doc_configs() -> list[tuple[str, dict]]:
    out = []
    for guide in GUIDES:
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", (REPO / guide).read_text(), re.S)):
            values = tomllib.loads(block)
            if "task" in values:  # a coordinator config (the guides also show pyproject snippets)
                out.append((f"{guide}#{i}", values))
    return out


CONFIGS = doc_configs()


def test_the_guides_have_gsm8k_recipes():
    assert sum("gsm8k" in v["task"] for _, v in CONFIGS) >= 3, [name for name, _ in CONFIGS]


def test_the_gpu_recipe_dry_runs_on_its_preset_as_written(tmp_path, capsys):
    """docs/gpu-swarm.md's `--config preset --config gsm8k-1.5b.toml --dry-run`, with the file as the page shows it."""
    from asyncrl.coordinator import cli

    page = (REPO / "docs/gpu-swarm.md").read_text()
    (tmp_path / "gsm8k-1.5b.toml").write_text(re.findall(r"```toml\n(.*?)```", page, re.S)[0])
    command = next(line for line in page.splitlines() if "--dry-run" in line and line.startswith("asyncrl-coordinator"))
    argv = command.split("#")[0].split()[1:]
    argv = [str(tmp_path / a) if a == "gsm8k-1.5b.toml" else str(REPO / a) if a.startswith("configs/") else a
            for a in argv]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["model"], got["task"], got["task_prompt_field"]) == ("Qwen/Qwen2.5-1.5B-Instruct",
                                                                    "hf:openai/gsm8k:main:train", "question")


@pytest.mark.parametrize("name,values", CONFIGS, ids=[n for n, _ in CONFIGS])
def test_doc_config_starts_as_written(name, values, tmp_path):
    task = values["task"]
    overrides = {}
    if "gsm8k" in task:  # hf:openai/gsm8k:... or data/gsm8k-train.jsonl: the same rows, written here
        path = tmp_path / "gsm8k-train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
        overrides["task"] = str(path)
    cfg = resolve_config(values, overrides, source=name)
    tokenizer, model_config = build_tokenizer(), build_config(context=32768)  # Qwen2.5-0.5B's context

    source = preflight.open_task(cfg, tokenizer, model_config)
    prompts = [next(source) for _ in range(len(GSM8K_ROWS))]
    assert source.report.records == len(GSM8K_ROWS) and source.report.skipped == 0
    for p in prompts:
        question = next(r["question"] for r in GSM8K_ROWS if r["question"] in p.text)  # the question is asked
        assert p.text.endswith("<|im_start|>assistant\n"), p.text  # templated for the model to answer
        if cfg.task_system_prompt:
            assert cfg.task_system_prompt in p.text.split(question)[0]
        gold = tasks.rewards.gold_answer(p.answer)
        assert gold in GOLD
        right = f"So the answer is $\\boxed{{{gold}}}$."
        wrong = f"So the answer is $\\boxed{{{int(gold) + 1}}}$."
        scored = tasks.score_group(p, [right, wrong], [[1], [2]])
        assert scored.rewards == [1.0, 0.0], (name, p.answer, scored)
