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


def chat_tokenizer():
    tok = tinymodel.build_tokenizer()
    tok.chat_template = TEMPLATE.replace("<|", "[").replace("|>", "]")
    return tok


def test_conversational_records_are_templated_and_carry_their_columns(tmp_path):
    from asyncrl.tasks.rewards import record_view

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2=?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": messages, "answer": "4", "level": 2},
        {"prompt": messages + [{"role": "assistant", "content": "it is "}], "answer": "4"},
    ])
    src = open_source(str(path), tokenizer=chat_tokenizer(), default_reward="math")
    got = {p.text: p for p in (next(src), next(src))}
    assert set(got) == {"[system]be brief[user]2+2=?[assistant]",   # generation prompt added
                        "[system]be brief[user]2+2=?[assistant]it is "}  # a prefilled turn is continued
    original, cols = record_view(got["[system]be brief[user]2+2=?[assistant]"])
    assert original == messages and cols == {"answer": "4", "level": 2}

    with pytest.raises(TaskSourceError) as err:
        open_source(str(path), tokenizer=chat_tokenizer(), chat_template="off")
    assert err.value.where == f"{path}:1"
    with pytest.raises(TaskSourceError):
        open_source(str(path), tokenizer=tinymodel.build_tokenizer())  # no template to render messages with


def test_system_prompt_wraps_plain_prompts(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1", "answer": "#### 2"}])
    src = open_source(str(path), tokenizer=chat_tokenizer(), prompt_field="question", system_prompt="think")
    assert next(src).text == "[system]think[user]1+1[assistant]"
    with pytest.raises(TaskSourceError):
        open_source(str(path), prompt_field="question", system_prompt="think")  # no template here


@pytest.mark.parametrize("prompt", [[], [{"role": "user"}], [{"role": "user", "content": [{"type": "image"}]}],
                                    [{"content": "x"}], [{"role": "system", "content": "only a system turn"}]])
def test_malformed_messages_are_refused_with_the_record(tmp_path, prompt):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": prompt, "answer": "1"}])
    with pytest.raises(TaskSourceError) as err:
        open_source(str(path), tokenizer=chat_tokenizer())
    assert err.value.line == 2


def test_reward_specs_per_record_and_batch_only_records_need_no_answer(tmp_path, monkeypatch):
    from asyncrl import tasks

    monkeypatch.setitem(tasks.REWARDS, "fmt", lambda completions, **kw: [1.0] * len(completions))
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "reward": "fmt"},
                                              {"prompt": "b", "answer": "1", "reward": ["math", "fmt"]}])
    src = open_source(str(path), default_reward="exact+0.5*fmt")
    assert {p.reward for p in (next(src), next(src))} == {"fmt", "math+fmt"}
    with pytest.raises(TaskSourceError):  # a simple reward needs an answer
        open_source(str(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "reward": "exact+fmt"}])))
    with pytest.raises(TaskSourceError):
        open_source(str(path), default_reward="nope+fmt")


def test_prompts_longer_than_the_context_allows_stop_the_start_or_are_skipped_and_counted(tmp_path):
    tok = tinymodel.build_tokenizer()  # one token per character
    rows = [{"prompt": "a" * 10, "answer": "x"}, {"prompt": "b" * 30, "answer": "x"}, {"prompt": "c" * 21, "answer": "x"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(TaskSourceError) as err:
        open_source(str(path), tokenizer=tok, max_prompt_tokens=20)
    assert err.value.where == f"{path}:2"  # the first offender, by line
    src = open_source(str(path), tokenizer=tok, max_prompt_tokens=20, oversized="skip")
    assert {next(src).text for _ in range(4)} == {"a" * 10}
    assert (src.report.records, src.report.skipped_long, src.report.longest_prompt_tokens) == (1, 2, 10)
    assert src.report.examples[0].startswith(f"{path}:2")
    with pytest.raises(TaskSourceError):
        open_source(str(path), tokenizer=tok, max_prompt_tokens=5, oversized="skip")  # nothing left


def test_records_too_big_for_a_lease_are_refused(tmp_path):
    from asyncrl.protocol import limits

    path = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "a", "answer": "x", "notes": "n" * limits.MAX_TASK_COLUMNS_CHARS}])
    with pytest.raises(TaskSourceError) as err:
        open_source(str(path))
    assert err.value.line == 1
    path = write_jsonl(tmp_path / "nan.jsonl", ['{"prompt": "a", "answer": "x", "score": NaN}'])
    with pytest.raises(TaskSourceError):
        open_source(str(path))  # not plain JSON: a reward would see different values on each side
