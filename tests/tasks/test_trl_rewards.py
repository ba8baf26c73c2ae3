"""TRL-style batch rewards, weighted sums and the reward spec (tasks/rewards.py), against hand-computed values."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from asyncrl import tasks
from asyncrl.protocol import limits
from asyncrl.tasks import rewards
from asyncrl.tasks.prompt import Prompt
from asyncrl.tasks.rewards import RewardError, format_spec, parse_spec, reward_shape, score_group


def columns(prompt, **cols) -> str:
    return json.dumps({"prompt": prompt, **cols}, sort_keys=True, separators=(",", ":"))


class Recorder:
    """A TRL-style reward that remembers what it was called with and returns scripted values."""

    def __init__(self, values):
        self.values, self.calls = values, []

    def __call__(self, prompts, completions, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, **kwargs})
        return list(self.values)


@pytest.fixture
def registry(monkeypatch):
    def register(name, fn):
        monkeypatch.setitem(tasks.REWARDS, name, fn)
        return fn
    return register


def test_weighted_sum_follows_trl_nansum_and_all_none_scores_zero(registry):
    registry("acc", Recorder([1.0, None, 0.5, None]))
    registry("fmt", Recorder([None, None, 2.0, 4.0]))
    p = Prompt("p", "q", "", "acc+0.5*fmt", columns("q"))
    got = score_group(p, ["a", "b", "c", "d"], [[1], [2], [3], [4]])
    # TRL: None -> NaN, nansum(w * r): [1, 0 (all None), 0.5 + 0.5*2, 0.5*4]
    assert got.rewards == [1.0, 0.0, 1.5, 2.0]
    assert got.all_none == 1
    assert got.per_reward == {"acc": [1.0, None, 0.5, None], "fmt": [None, None, 2.0, 4.0]}


def test_nan_counts_as_none_and_batch_values_are_not_clamped(registry):
    registry("neg", Recorder([-3.0, math.nan]))
    got = score_group(Prompt("p", "q", "", "neg", columns("q")), ["a", "b"], [[1], [2]])
    assert got.rewards == [-3.0, 0.0] and got.all_none == 1


def test_simple_rewards_keep_their_clamp_inside_a_weighted_sum(registry):
    registry("wild", rewards.simple_reward(lambda completion, answer: 7.0 if completion == answer else float("nan")))
    registry("bonus", Recorder([0.25, 0.25]))
    got = score_group(Prompt("p", "q", "x", "2.0*wild+bonus", columns("q", answer="x")), ["x", "y"], [[1], [2]])
    assert got.rewards == [2.0 * 1.0 + 0.25, 2.0 * 0.0 + 0.25]
    assert tasks.score("wild", "x", "x") == 1.0  # the one-completion API is unchanged


def test_batch_reward_gets_columns_ids_and_the_dataset_prompt(registry):
    rec = registry("cols", Recorder([0.0, 1.0]))
    p = Prompt("p", "<templated>q", "42", "cols", columns("what is 6*7?", answer="42", level=3, tags=["a"]))
    score_group(p, ["41", "42"], [[7, 8], [9]])
    call = rec.calls[0]
    assert call["prompts"] == ["what is 6*7?"] * 2          # the dataset's prompt, not the templated text
    assert call["completions"] == ["41", "42"]
    assert call["answer"] == ["42", "42"] and call["level"] == [3, 3] and call["tags"] == [["a"], ["a"]]
    assert call["completion_ids"] == [[7, 8], [9]]


def test_conversational_prompts_get_message_completions_with_a_prefilled_turn(registry):
    rec = registry("chat", Recorder([1.0, 1.0]))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    score_group(Prompt("p", "t", "", "chat", columns(messages)), ["yo", "hey"], [[1], [2]])
    assert rec.calls[0]["prompts"] == [messages, messages]
    assert rec.calls[0]["completions"] == [[{"role": "assistant", "content": "yo"}],
                                           [{"role": "assistant", "content": "hey"}]]
    prefilled = messages + [{"role": "assistant", "content": "Answer: "}]
    score_group(Prompt("p", "t", "", "chat", columns(prefilled)), ["yo", "hey"], [[1], [2]])
    assert rec.calls[1]["completions"][0] == [{"role": "assistant", "content": "Answer: yo"}]  # TRL's bootstrap


def test_every_function_is_trl_form_unless_declared_simple():
    def trl(completions, **kwargs):
        return [1.0] * len(completions)

    def ids_only(completion_ids, **kwargs):  # TRL's Example 1: no `completions` parameter, still TRL's form
        return [float(len(ids)) for ids in completion_ids]

    def plain(completion, answer):
        return 1.0

    assert reward_shape(trl) == reward_shape(ids_only) == reward_shape(plain) == "trl"
    assert reward_shape(rewards.simple_reward(plain)) == "simple"
    assert reward_shape(Recorder([])) == "trl"
    assert {reward_shape(tasks.get_reward(n)) for n in ("exact", "math", "repeat")} == {"simple"}
    ok = Prompt("p", "q", "", "ids", columns("q"))
    rewards.REWARDS["ids"] = ids_only
    try:
        assert score_group(ok, ["ab", "c"], [[1, 2], [3]]).rewards == [2.0, 1.0]
    finally:
        del rewards.REWARDS["ids"]


class FakeRewardModel:
    """Stands for TRL's reward-model form: a torch module, not a function."""


@pytest.mark.parametrize("fn, columns, parameter", [
    (lambda completion, answer: 1.0, ["answer"], "'completion'"),                   # undeclared simple form
    (lambda completions, environments, **kw: [], ["answer"], "'environments'"),
    (lambda completions, difficulty, **kw: [], ["answer"], "'difficulty'"),          # not a column of the record
    (lambda completions, /, **kw: [], ["answer"], "'completions'"),                  # positional-only
])
def test_a_function_asyncrl_cannot_call_is_refused_naming_the_parameter(fn, columns, parameter):
    with pytest.raises(RewardError, match=parameter):
        rewards.check_reward("r", fn, columns)


def test_reward_models_are_refused():
    import torch

    with pytest.raises(RewardError, match="reward models are not supported"):
        rewards.check_reward("rm", torch.nn.Linear(2, 1), ["answer"])
    with pytest.raises(RewardError, match="not supported"):
        rewards.check_reward("rm", "OpenAssistant/reward-model-deberta-v3-large-v2", ["answer"])


def test_the_simple_form_declared_and_columns_named_as_keywords_are_accepted():
    assert rewards.check_reward("s", rewards.simple_reward(lambda completion, answer: 1.0), []) == "simple"
    assert rewards.check_reward("c", lambda completions, difficulty, trainer_state, **kw: [], ["difficulty"]) == "trl"
    with pytest.raises(RewardError, match="fn.completion, answer."):
        rewards.check_reward("s", rewards.simple_reward(lambda completions: 1.0), [])


def test_async_rewards_are_awaited_and_trainer_state_is_the_sampled_version(registry):
    import asyncio

    seen = {}

    async def slow(prompts, completions, trainer_state, log_extra=None, log_metric=None, **kwargs):
        await asyncio.sleep(0)
        seen["step"] = trainer_state.global_step
        log_extra("col", [1] * len(completions))  # TRL's logging callables exist and may be called
        log_metric("m", 1.0)
        return [1.0 if c else 0.0 for c in completions]

    registry("slow", slow)
    got = score_group(Prompt("p", "q", "", "slow", columns("q")), ["a", ""], [[1], []], version=7)
    assert got.rewards == [1.0, 0.0] and seen["step"] == 7

    async def inside_a_loop():  # a caller already inside an event loop (a hivemind handler) gets the same
        return score_group(Prompt("p", "q", "", "slow", columns("q")), ["a", ""], [[1], []], version=3)
    assert asyncio.run(inside_a_loop()).rewards == [1.0, 0.0] and seen["step"] == 3


def test_trainer_state_beyond_global_step_is_a_clear_error(registry):
    registry("curriculum", lambda completions, trainer_state, **kw: [trainer_state.max_steps] * len(completions))
    with pytest.raises(AttributeError, match="only global_step"):
        score_group(Prompt("p", "q", "", "curriculum", columns("q")), ["a"], [[1]])


def test_a_reward_without_var_kwargs_gets_only_the_columns_it_names(registry):
    def strict(completions, answer):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]
    registry("strict", strict)
    got = score_group(Prompt("p", "q", "4", "strict", columns("q", answer="4", noise="x")), ["4", "5"], [[1], [2]])
    assert got.rewards == [1.0, 0.0]


@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0, 3.0], ["1.0", 1.0], [math.inf, 0.0], 5.0])
def test_a_batch_reward_returning_the_wrong_thing_is_an_error(registry, values):
    registry("broken", lambda prompts, completions, **kw: values)
    with pytest.raises(RewardError):
        score_group(Prompt("p", "q", "", "broken", columns("q")), ["a", "b"], [[1], [2]])


def test_a_total_beyond_the_wire_bound_is_an_error(registry):
    registry("huge", Recorder([limits.MAX_ABS_REWARD, 1.0]))
    with pytest.raises(RewardError):
        score_group(Prompt("p", "q", "", "2*huge", columns("q")), ["a", "b"], [[1], [2]])


def test_spec_round_trips_and_rejects_bad_specs():
    assert format_spec(["accuracy", "format"], [1.0, 0.5]) == "accuracy+0.5*format"
    assert format_spec("math") == "math"
    assert parse_spec("accuracy+0.5*format+-1e-3*length") == (
        rewards.RewardTerm("accuracy", 1.0), rewards.RewardTerm("format", 0.5), rewards.RewardTerm("length", -0.001))
    for bad in ["", "a+a", "x*math", "inf*math", "ma th", "math+"]:
        with pytest.raises(RewardError):
            parse_spec(bad)
    with pytest.raises(RewardError):
        format_spec(["a", "b"], [1.0])  # one weight per reward, as TRL requires


def test_trl_reward_through_entry_points(tmp_path, monkeypatch):
    """The same `asyncrl.rewards` group a simple reward uses: a TRL-style function is found and scored."""
    pkg = tmp_path / "lab_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        def think_format(completions, **kwargs):
            texts = [c[0]["content"] for c in completions]
            return [1.0 if t.startswith("<think>") else 0.0 for t in texts]
    '''))
    dist = tmp_path / "lab_rewards-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-rewards\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[asyncrl.rewards]\nthink_format = lab_rewards:think_format\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(tasks.REWARDS, "think_format", raising=False)
    try:
        assert rewards.check_spec("think_format+math") == "think_format+math"
        p = Prompt("p", "t", "4", "think_format+math", columns([{"role": "user", "content": "2+2?"}], answer="4"))
        got = score_group(p, ["<think>2+2</think> 4", "5"], [[1], [2]])
        assert got.rewards == [2.0, 0.0]
    finally:
        tasks.REWARDS.pop("think_format", None)


def test_math_reads_gsm8k_and_boxed_gold_answers():
    gsm8k = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert tasks.score("math", "So she sold 72 clips.", gsm8k) == 1.0
    assert tasks.score("math", "The answer is \\boxed{72}", gsm8k) == 1.0
    assert tasks.score("math", "24", gsm8k) == 0.0  # a number from the worked solution is not the answer
    assert tasks.score("math", "The answer is 1234", "#### 1,234") == 1.0
    assert tasks.score("math", "#### 1234", "#### 1235") == 0.0
    assert tasks.score("math", "so x = 1/2", "The sum is $\\boxed{\\frac{1}{2}}$") == 1.0
    assert tasks.score("math", "answer \\boxed{6}", "The sum is $\\boxed{5}$") == 0.0
