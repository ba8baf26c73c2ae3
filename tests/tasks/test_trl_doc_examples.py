"""TRL's documented reward examples (tests/trl_doc_rewards, verbatim), found through the `asyncrl.rewards`
entry points and scored by `score_group` exactly as TRL's docs say they score: the values TRL's docs print
for their "You can test it as follows" calls, None where a multi-task reward does not apply, async awaited."""

from __future__ import annotations

import json

import pytest

from asyncrl import tasks
from asyncrl.tasks.prompt import Prompt
from asyncrl.tasks.rewards import score_group
from tests.conftest import REPO

PKG = REPO / "tests" / "trl_doc_rewards"
NAMES = ["trl_token_length", "trl_char_length", "trl_format", "trl_reference", "trl_math_task", "trl_coding_task",
         "trl_async", "trl_logging"]


@pytest.fixture
def doc_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(PKG))
    for name in NAMES:
        monkeypatch.delitem(tasks.REWARDS, name, raising=False)
    yield
    for name in NAMES:
        tasks.REWARDS.pop(name, None)


def record(prompt, **cols) -> str:
    return json.dumps({"prompt": prompt, **cols}, sort_keys=True, separators=(",", ":"))


def scored(name, prompt, texts, ids, **cols):
    return score_group(Prompt("p", "t", "", name, record(prompt, **cols)), texts, ids).per_reward[name]


def test_the_documented_values(doc_rewards):
    ids = [[6303, 13], [304, 279, 12884, 13]]
    assert scored("trl_token_length", "The sky is", [" blue.", " in the sky."], ids) == [2.0, 4.0]
    assert scored("trl_char_length", "The sky is", [" blue.", " in the sky."], ids) == [6.0, 12.0]
    chat = [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}]
    assert scored("trl_format", chat, ["<think>The sum is 3.</think><answer>12</answer>", "It is 12."],
                  [[1], [2]]) == [1.0, 0.0]
    texts = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
    assert scored("trl_reference", "Problem: 2x + 3 = 7", texts, [[1], [2]], ground_truth="2") == [1.0, 0.0]
    assert scored("trl_logging", "Problem: 2x + 3 = 7", texts, [[1], [2]], ground_truth="2") == [1.0, 0.0]
    assert scored("trl_async", "The sky is", [" blue.", ""], [[1], []]) == [1.0, 0.0]


def test_multi_task_rewards_say_none_where_they_do_not_apply(doc_rewards):
    got = score_group(Prompt("p", "t", "", "trl_math_task+trl_coding_task", record("What is 2+2?", task="math")),
                      ["4", "four"], [[1], [2]])
    assert got.per_reward == {"trl_math_task": [1.0, -1.0], "trl_coding_task": [None, None]}
    assert got.rewards == [1.0, -1.0]


def test_a_reward_needing_a_missing_column_is_refused_when_the_task_opens(doc_rewards, tmp_path):
    from asyncrl.tasks.sources import TaskSourceError, read_jsonl

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "q", "reward": "trl_reference"}) + "\n")
    with pytest.raises(TaskSourceError, match="'ground_truth'") as err:
        read_jsonl(path)
    assert err.value.line == 1
    assert tasks.reward_package("trl_reference") == ("trl-doc-rewards", "1.17.0")
    assert tasks.reward_package("math") is None  # a built-in ships with asyncrl
