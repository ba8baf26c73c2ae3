"""Task sources: JSONL and Hugging Face datasets (a local save_to_disk directory), positions, templates."""

from __future__ import annotations

import json

import pytest

from asyncrl.models import tinymodel
from asyncrl.tasks.sources import TaskSourceError, encode_prompt, open_source

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_records_cycle_with_unique_ids_and_resume_by_position(tmp_path):
    path = write_jsonl(tmp_path / "toy.jsonl", [{"prompt": "1+1=", "answer": "2"}, "",
                                               {"prompt": "2+2=", "answer": 4, "reward": "exact"},
                                               {"prompt": "rep:a=", "answer": "a", "reward": "repeat"}])
    src = open_source(str(path), seed=1)
    first = [next(src) for _ in range(7)]
    assert len({p.prompt_id for p in first}) == 7  # unique across epochs
    assert sorted(p.text for p in first[:3]) == ["1+1=", "2+2=", "rep:a="]  # one epoch = every record once
    assert {p.answer for p in first} == {"2", "4", "a"}
    assert {p.reward for p in first} == {"exact", "repeat"}

    again = open_source(f"jsonl:{path}", seed=1)
    again.restore(json.loads(json.dumps(src.state())))
    assert [next(again) for _ in range(5)] == [next(src) for _ in range(5)]


@pytest.mark.parametrize("line", [
    "{not json",
    json.dumps({"prompt": "x"}),
    json.dumps({"prompt": "x", "answer": "y", "reward": "no-such-reward"}),
    json.dumps(["prompt", "answer"]),
])
def test_a_bad_jsonl_line_is_refused_at_start_with_its_line_number(tmp_path, line):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "b"}, "", line])
    with pytest.raises(TaskSourceError) as err:
        open_source(str(path))
    assert err.value.line == 3 and err.value.where == f"{path}:3"


def test_unknown_spec_and_missing_file_are_errors(tmp_path):
    with pytest.raises(TaskSourceError):
        open_source("no-such-task")
    with pytest.raises(TaskSourceError):
        open_source(str(tmp_path / "missing.jsonl"))


def test_hf_dataset_from_a_local_directory_with_configured_fields(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"question": ["3+4=", "5+1="], "solution": ["7", "6"], "other": [1, 2]})
    ds.save_to_disk(str(tmp_path / "arith"))
    src = open_source(f"hf:{tmp_path / 'arith'}", prompt_field="question", answer_field="solution",
                      default_reward="exact")
    got = {(p.text, p.answer, p.reward) for p in (next(src), next(src))}
    assert got == {("3+4=", "7", "exact"), ("5+1=", "6", "exact")}
    with pytest.raises(TaskSourceError):
        open_source(f"hf:{tmp_path / 'arith'}")  # default field names are not columns here

    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "split"))
    test_only = open_source(f"hf:{tmp_path / 'split'}:test", prompt_field="question", answer_field="solution")
    assert {next(test_only).text for _ in range(3)} == {"3+4="}


def test_chat_template_is_applied_and_both_tokenisation_sites_agree(tmp_path):
    tok = tinymodel.build_tokenizer()
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "answer": "x"}])
    assert next(open_source(str(path), tokenizer=tok)).text == "hi"  # no template: raw text
    with pytest.raises(TaskSourceError):
        open_source(str(path), tokenizer=tok, chat_template="on")
    tok.chat_template = TEMPLATE.replace("<|", "[").replace("|>", "]")
    prompt = next(open_source(str(path), tokenizer=tok))
    assert prompt.text == "[user]hi[assistant]"
    assert next(open_source(str(path), tokenizer=tok, chat_template="off")).text == "hi"
    assert next(open_source("repeat", tokenizer=tok)).text.startswith("rep:")  # toy tasks stay raw
    ids = encode_prompt(tok, prompt.text)
    assert tok.decode(ids) == prompt.text and ids == encode_prompt(tok, prompt.text)
