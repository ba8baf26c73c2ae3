"""`asyncrl-coordinator eval` (coordinator/operator/evaluate.py) on the tiny model: its completions and accuracy are
what stock transformers + peft give for the exported adapter, one problem at a time, unpadded; the adapter is
really applied (the base answers differently); problems the run trained on are refused (SPLIT_OVERLAP)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")

SUMS = ("min_terms=2", "max_terms=2", "min_digits=1", "max_digits=2")
LORA = dict(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "o_proj"))
N, MAX_NEW = 10, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory: config.json with a reasoning_gym task and one checkpoint of a non-trivial adapter."""
    from asyncrl.coordinator.config import CoordinatorConfig

    from tests.coordinator.trained import trained_run

    made = trained_run(tmp_path_factory.mktemp("eval"), LORA, b_scale=0.3)
    run_dir, model_dir = made["run"], made["model"]
    cfg = CoordinatorConfig(model=str(model_dir), run_dir=str(run_dir), task="reasoning_gym:chain_sum",
                            task_params=SUMS, task_size=300, task_eval_size=40, max_new_tokens=MAX_NEW,
                            task_system_prompt="reasoning_gym:direct", task_reward="exact").validate()
    cfg.write(run_dir)
    return {"run": run_dir, "model": str(model_dir), "cfg": cfg}


def run_eval(run, tmp_path, *extra) -> tuple[int, dict]:
    from asyncrl.coordinator import cli

    out = tmp_path / f"eval{len(list(tmp_path.iterdir()))}.json"
    code = cli.main(["eval", "--run-dir", str(run["run"]), "--n", str(N), "--batch-size", "4", "--no-progress",
                     "--json-out", str(out), *extra])
    return code, (json.loads(out.read_text()) if out.exists() else {})


def stock_completions(run, tmp_path, *, adapter: bool) -> list[str]:
    """Plain transformers (+ peft on `asyncrl-coordinator export`'s directory), one prompt at a time."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.coordinator import cli
    from asyncrl.models.pinning import stop_token_ids
    from asyncrl.tasks.sources import encode_prompt, open_source

    tok = AutoTokenizer.from_pretrained(run["model"])
    model = AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float32)
    if adapter:
        out = tmp_path / "exported"
        assert cli.main(["export", "--run-dir", str(run["run"]), "--out", str(out)]) == 0
        model = PeftModel.from_pretrained(model, str(out))
    model.eval()
    stops = list(stop_token_ids(run["model"], tok))
    source = open_source(run["cfg"].task, tokenizer=tok, split="eval", **run["cfg"].task_options())
    texts = []
    for _ in range(N):
        ids = torch.tensor([encode_prompt(tok, next(source).text)])
        with torch.no_grad():
            row = model.generate(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)[0, ids.shape[1]:].tolist()
        row = row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))]
        texts.append(tok.decode(row, skip_special_tokens=True))
    return texts


def test_eval_gives_what_stock_peft_gives_for_the_exported_adapter(run, tmp_path):
    from asyncrl.tasks import score_group
    from asyncrl.tasks.sources import open_source

    code, report = run_eval(run, tmp_path)
    assert code == 0 and report["n"] == N and report["step"] is not None and not report["base"]
    mine = [it["completion"] for it in report["items"]]
    assert mine == stock_completions(run, tmp_path, adapter=True)
    source = open_source(run["cfg"].task, split="eval", **run["cfg"].task_options())
    correct = sum(score_group(next(source), [t], [[]]).rewards[0] == 1.0 for t in mine)
    assert report["correct"] == correct and report["accuracy"] == correct / N

    code, base = run_eval(run, tmp_path, "--base")
    assert code == 0 and base["base"]
    assert [it["completion"] for it in base["items"]] == stock_completions(run, tmp_path, adapter=False)
    assert [it["completion"] for it in base["items"]] != mine  # the adapter is applied


def test_eval_refuses_problems_the_run_trained_on(run, tmp_path, capsys):
    code, _ = run_eval(run, tmp_path, "--task-eval-seed", "100")  # the train split holds seeds 0..299
    assert code == 2 and "SPLIT_OVERLAP" in capsys.readouterr().err
