"""Rewards: built-ins, math-verify with a time limit, third-party entry points."""

import textwrap

import pytest

from asyncrl import tasks


def test_repeat_and_exact():
    assert tasks.score("repeat", "aaaabbbb", "a") == 0.5
    assert tasks.score("repeat", "", "a") == 0.0
    assert tasks.score("exact", " 42 \n", "42") == 1.0
    assert tasks.score("exact", "41", "42") == 0.0


def test_math_reward_verifies_equivalent_answers():
    assert tasks.score("math", "so the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert tasks.score("math", "the answer is $3$", "4") == 0.0
    assert tasks.score("math", "no number here", "4") == 0.0


def test_math_reward_time_limit_is_unscorable_and_recovers():
    from asyncrl.tasks.math_reward import VerifierPool

    pool = VerifierPool(timeout_s=0.001, workers=1)  # a tiny limit forces the timeout path: worker killed
    try:
        with pytest.raises(tasks.Unscorable):
            pool.score("$2^{2^{2^{2^{2}}}}$", "1")
        pool.timeout_s = 60.0
        assert pool.score("the answer is $4$", "4") == 1.0  # a fresh worker took its place
        assert pool.stats["killed"] == 1
    finally:
        pool.close()


def test_a_failing_reward_plugin_is_unscorable_not_zero(monkeypatch):
    def broken(completion, answer):
        raise RuntimeError("plugin bug")

    monkeypatch.setitem(tasks.REWARDS, "broken", tasks.simple_reward(broken))
    with pytest.raises(tasks.Unscorable):
        tasks.score("broken", "x", "y")


def test_a_reward_returning_the_wrong_thing_is_unscorable_and_an_unknown_name_stays_a_config_error(monkeypatch):
    monkeypatch.setitem(tasks.REWARDS, "wrong", tasks.batch_reward(lambda prompts, completions, **kw: ["x"]))
    with pytest.raises(tasks.Unscorable):
        tasks.score("wrong", "x", "y")  # score_group raises RewardError: our reward's fault, not the volunteer's
    with pytest.raises(tasks.UnknownReward):
        tasks.score("no-such-reward", "x", "y")


def test_unknown_reward_is_a_clear_error():
    with pytest.raises(tasks.UnknownReward):
        tasks.get_reward("no-such-reward")


def test_third_party_reward_through_entry_points(tmp_path, monkeypatch):
    pkg = tmp_path / "acme_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from asyncrl.tasks import simple_reward\n\n@simple_reward\ndef shout(completion, answer):\n    return 1.0 if completion.isupper() else 0.25\n")
    dist = tmp_path / "acme_rewards-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-rewards\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""
        [asyncrl.rewards]
        shout = acme_rewards:shout
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(tasks.REWARDS, "shout", raising=False)
    assert tasks.score("shout", "HELLO", "") == 1.0
    assert tasks.score("shout", "hello", "") == 0.25
    tasks.REWARDS.pop("shout", None)


def test_scores_are_clamped_into_unit_interval(monkeypatch):
    monkeypatch.setitem(tasks.REWARDS, "wild", tasks.simple_reward(lambda c, a: 7.0))
    assert tasks.score("wild", "x", "y") == 1.0
    monkeypatch.setitem(tasks.REWARDS, "nan", tasks.simple_reward(lambda c, a: float("nan")))
    assert tasks.score("nan", "x", "y") == 0.0


def test_the_printable_table_is_a_lower_bound_and_exact_is_skipped_only_when_hopeless():
    """The coordinator may re-score `exact` without decoding only where decoding could not give 1.0."""
    import numpy as np

    from asyncrl.models import tinymodel

    tok = tinymodel.build_tokenizer()
    table = tasks.PrintableTable(tok, vocab_size=len(tok) + 10)
    assert table.table is not None and table.problem is None
    rng = np.random.default_rng(1)
    for _ in range(300):
        ids = rng.integers(0, len(tok), size=int(rng.integers(0, 40)))
        text = tok.decode(ids.tolist(), skip_special_tokens=True)
        assert table.lower_bound(ids) <= tasks.rewards.printable_count(text)
        [floor] = table.lower_bounds([ids])
        assert floor == table.lower_bound(ids)
        for answer in (text, text.strip(), "42", ""):
            if tasks.impossible("exact", floor, answer):
                assert tasks.score("exact", text, answer) == 0.0  # never skips a completion that scores
    answer_ids = tok(" 42 ", add_special_tokens=False)["input_ids"]
    assert not tasks.impossible("exact", table.lower_bound(answer_ids), "42")  # the right answer is decoded
    assert tasks.impossible("exact", table.lower_bound(tok("4242", add_special_tokens=False)["input_ids"]), "42")
    assert not tasks.impossible("math", 10**6, "42")  # only rewards that allow it


def test_a_tokenizer_that_breaks_the_bound_gets_no_table():
    from asyncrl.models import tinymodel

    class Merging:
        """A decoder that drops characters at joins (no real one does): the self-check must catch it."""

        def __init__(self):
            self.inner = tinymodel.build_tokenizer()
            self.all_special_ids = self.inner.all_special_ids

        def __len__(self):
            return len(self.inner)

        def decode(self, ids, skip_special_tokens=True):
            text = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
            return text if isinstance(ids, int) or len(ids) < 2 else text[len(text) // 2:]

    table = tasks.PrintableTable(Merging())
    assert table.table is None and table.problem
