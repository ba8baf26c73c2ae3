"""Episodes end to end without a model: a scripted policy plays the built-in environments through the chat
template, the replay reproduces every episode, and each kind of tampering is caught at its turn."""

from __future__ import annotations

import threading

import pytest

from asyncrl import envs
from asyncrl.envs.calculator import calculate, same_number
from asyncrl.models import tinymodel

from .chat import qwen_style_tokenizer
from .scripted import ScriptedPolicy

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17*23+4"}}\n</tool_call>'
RECORD = {"question": "What is 17*23+4?", "answer": "395"}


@pytest.fixture(scope="module")
def qwen():
    return qwen_style_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    return tinymodel.build_tokenizer()


def play(name, tokenizer, turns, record=None, seed=7, max_new_tokens=128):
    env = envs.get_env(name)
    policy = ScriptedPolicy(tokenizer, turns)
    (session,) = envs.run_episodes(env, envs.Renderer(tokenizer), [(record or {}, seed)], policy,
                                   stop_token_ids=(tokenizer.eos_token_id,), max_new_tokens=max_new_tokens)
    return env, session


def replay(env, tokenizer, session, *, tokens=None, mask=None, record=None, seed=7, max_new_tokens=128):
    return envs.replay(env, envs.Renderer(tokenizer), record=record if record is not None else session.record,
                       seed=seed, prompt_ids=session.prompt_ids,
                       tokens=session.tokens if tokens is None else tokens,
                       env_mask=session.env_mask if mask is None else mask,
                       stop_token_ids=(tokenizer.eos_token_id,), max_new_tokens=max_new_tokens)


def test_calculator_episode_through_qwen_chat_template(qwen):
    env, s = play("calculator", qwen, [CALL, "17*23+4 = 395"], RECORD)
    assert s.turns == 2 and s.reward == 1.0 and s.finish_reason == "stop"
    runs = envs.segments(s.env_mask)
    assert [r[2] for r in runs] == [0, 1, 0]  # model, tool response, model
    start, end, _ = runs[1]
    assert qwen.decode(s.tokens[start:end]) == ("\n<|im_start|>user\n<tool_response>\n395\n</tool_response><|im_end|>\n"
                                                "<|im_start|>assistant\n")
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.env_mask) if m)
    assert all(lp == -1.0 for lp, m in zip(s.logprobs, s.env_mask) if not m)
    again = replay(env, qwen, s)
    assert (again.reward, again.finish_reason, again.tokens) == (1.0, "stop", s.tokens)


def test_the_wrong_final_answer_scores_zero(qwen):
    _, s = play("calculator", qwen, [CALL, "it is 394"], RECORD)
    assert s.reward == 0.0


def test_echo_game_has_three_turns_and_feedback(tiny):
    env, s = play("echo", tiny, ["a"], max_new_tokens=3)
    targets = env.reset({}, 7).state["targets"]
    assert s.turns == 3 and envs.segments(s.env_mask)[-1][2] == 0
    assert s.reward == pytest.approx(sum(t == "a" for t in targets) / 3)
    feedback = [tiny.decode(s.tokens[a:b]) for a, b, e in envs.segments(s.env_mask) if e]
    assert feedback == [f" {'ok.' if t == 'a' else 'no, ' + t + '.'} say {n} " for t, n in zip(targets, targets[1:])]
    assert replay(env, tiny, s, max_new_tokens=3).reward == s.reward


def tampered(qwen):
    env, s = play("calculator", qwen, [CALL, "17*23+4 = 395"], RECORD)
    (m0, m1, _), (e0, e1, _), (n0, n1, _) = envs.segments(s.env_mask)
    nine = qwen("9", add_special_tokens=False)["input_ids"][0]
    edited = list(s.tokens)
    edited[e0 + s.tokens[e0:e1].index(qwen("3", add_special_tokens=False)["input_ids"][0])] = nine
    fake = qwen(" ok", add_special_tokens=False)["input_ids"]
    return env, s, {
        "edited tool result": (edited, s.env_mask),
        "dropped turn": (s.tokens[:m1], s.env_mask[:m1]),
        "fake environment message": (s.tokens + fake, s.env_mask + [1] * len(fake)),
        "own tokens marked as environment": (s.tokens, s.env_mask[:n0] + [1] * 3 + s.env_mask[n0 + 3:]),
        "environment turn marked as the model's": (s.tokens, [0] * len(s.tokens)),
    }


@pytest.mark.parametrize("case", ["edited tool result", "dropped turn", "fake environment message",
                                  "own tokens marked as environment", "environment turn marked as the model's"])
def test_replay_refuses_every_tampering(qwen, case):
    env, s, cases = tampered(qwen)
    tokens, mask = cases[case]
    with pytest.raises(envs.EpisodeMismatch):
        replay(env, qwen, s, tokens=tokens, mask=mask)


def test_another_record_or_seed_is_another_episode(tiny):
    env, s = play("echo", tiny, ["a"], max_new_tokens=3)
    other = next(seed for seed in range(100) if env.reset({}, seed).state["targets"] != env.reset({}, 7).state["targets"])
    with pytest.raises(envs.EpisodeMismatch):
        replay(env, tiny, s, seed=other, max_new_tokens=3)


class HangingEnv:
    """Its second step never returns (until the test releases it)."""

    name = "hanging"
    limits = envs.EnvLimits(max_turns=3, step_timeout_s=0.2)

    def __init__(self):
        self.release = threading.Event()

    def reset(self, record, seed):
        return envs.Reset([{"role": "user", "content": "hi"}], {"n": 0})

    def step(self, state, assistant):
        state["n"] += 1
        if state["n"] == 2:
            self.release.wait()
        return envs.StepResult([{"role": "user", "content": "again"}], done=False)

    def final_reward(self, state):
        return 0.0


def test_a_hanging_environment_is_an_env_error_not_a_mismatch(tiny):
    env = HangingEnv()
    try:
        with pytest.raises(envs.EnvError):
            envs.run_episodes(env, envs.Renderer(tiny), [({}, 0)], ScriptedPolicy(tiny, ["a"]),
                              stop_token_ids=(tiny.eos_token_id,), max_new_tokens=4)
    finally:
        env.release.set()


def test_limits_end_the_episode(tiny):
    class Chatty(HangingEnv):
        limits = envs.EnvLimits(max_turns=10, max_env_tokens=20, max_total_tokens=40, step_timeout_s=1.0)

    env = Chatty()
    env.release.set()
    (s,) = envs.run_episodes(env, envs.Renderer(tiny), [({}, 0)], ScriptedPolicy(tiny, ["ab"]),
                             stop_token_ids=(tiny.eos_token_id,), max_new_tokens=4)
    env_tokens = sum(s.env_mask)
    assert env_tokens <= 20 and len(s.tokens) < 40 and s.turns < 10  # " again " is 7 tokens: 2 fit, not 3
    assert env_tokens == 14 and s.turns == 3 and s.finish_reason == "stop"
    replayed = envs.replay(env, envs.Renderer(tiny), record={}, seed=0, prompt_ids=s.prompt_ids, tokens=s.tokens,
                           env_mask=s.env_mask, stop_token_ids=(tiny.eos_token_id,), max_new_tokens=4)
    assert replayed.turns == 3


def test_tool_calls_in_the_hermes_format():
    calls = envs.parse_tool_calls(CALL + ' then <tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"2**3\\"}"}'
                                  '</tool_call> <tool_call>nope</tool_call>')
    assert calls[0] == envs.ToolCall("calculate", {"expression": "17*23+4"})
    assert calls[1] == envs.ToolCall("calculate", {"expression": "2**3"})
    assert calls[2].startswith("error")
    tools = {"calculate": envs.tool(calculate)}
    assert [m["content"] for m in envs.run_tool_calls(calls, tools)][:2] == ["395", "8"]
    assert envs.run_tool_calls([envs.ToolCall("calculate", {"expression": "__import__('os')"})], tools)[0][
        "content"].startswith("error: ValueError")
    assert tools["calculate"].schema["function"]["parameters"]["required"] == ["expression"]
    assert same_number("so 1,234.0", "1234") and not same_number("no number", "3")


def test_a_volunteer_without_the_pinned_environment_is_told_how_to_install_it():
    mine = envs.pin("echo")
    assert envs.check_pin(mine) is None
    other = dict(mine, sha256="0" * 64)
    assert envs.check_pin(other)[1].startswith("pip install 'asyncrl==")
    missing = {"name": "no-such-env", "package": "asyncrl-envs-extra", "version": "1.2"}
    assert envs.check_pin(missing) == (envs.check_pin(missing)[0], "pip install 'asyncrl-envs-extra==1.2'")
    assert "not installed" in envs.check_pin(missing)[0]


def test_a_template_without_tools_gets_qwens_tool_block(qwen, tiny):
    """Qwen's template renders `tools=` itself; for one that ignores it (SmolLM2's ChatML) the renderer writes
    the very same block into the system turn."""
    from asyncrl.envs.render import tool_system_text

    env = envs.get_env("calculator")
    opened = env.reset(RECORD, 1)
    system = opened.messages[0]["content"]
    assert tool_system_text(system, opened.tools) in envs.Renderer(qwen).prompt_text(opened.messages, opened.tools)
    chatml = tinymodel.build_tokenizer(instruct=True)  # a ChatML template that ignores tools
    rendered = envs.Renderer(chatml).prompt_text(opened.messages, opened.tools)
    assert rendered.startswith("<|im_start|>system " + tool_system_text(system, opened.tools))
