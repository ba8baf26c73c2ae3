"""reasoning-gym as a task source (tasks/rgym.py): split separation, deterministic regeneration, the
dataset's own scoring on the answer-tag text, and the coordinator's re-scoring of claimed rewards at ingest."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("reasoning_gym")

from asyncrl.coordinator.ingest.ingest import Ingest  # noqa: E402
from asyncrl.coordinator.leasing.taskboard import TaskBoard  # noqa: E402
from asyncrl.models import tinymodel  # noqa: E402
from asyncrl.protocol import envelope, messages  # noqa: E402
from asyncrl.protocol.identity import Identity  # noqa: E402
from asyncrl.tasks import rgym, score_group  # noqa: E402
from asyncrl.tasks.sources import TaskSourceError, encode_prompt, open_source  # noqa: E402

SUMS = ("min_terms=2", "max_terms=2", "min_digits=1", "max_digits=1")  # 1-digit sums: a space of ~200 problems
COORD = Identity.from_seed(bytes(range(32)))
ALICE = Identity.from_seed(bytes(range(1, 33)))
SAMPLING = messages.SamplingParams(temperature=1.0, max_new_tokens=24)


def opts(**kw) -> rgym.SplitOptions:
    return rgym.SplitOptions(**{"params": SUMS, "size": 300, "eval_size": 60, **kw})


def questions(source, n) -> list[str]:
    return [json.loads(next(source).columns)["prompt"] for _ in range(n)]


def test_train_and_eval_splits_share_no_question_even_where_the_space_is_small():
    train, evals, held = rgym.splits("chain_sum", opts())
    # 300 draws from ~200 problems against 60 evaluation problems: collisions are certain, so some are held out
    assert held > 0 and len(train) == 300 - held
    assert not {e["question"] for e in train} & {e["question"] for e in evals}
    # the evaluation split is the generator's own output, untouched
    assert [e["question"] for e in evals] == [e["question"] for e in rgym.generate(
        "chain_sum", rgym.parse_params(SUMS), 60, rgym.EVAL_SEED_OFFSET)]
    with pytest.raises(rgym.SplitOverlap, match="SPLIT_OVERLAP"):
        rgym.check_disjoint(train + evals[:1], evals)


def test_splits_whose_seed_ranges_meet_are_refused():
    # problem i of seed s is drawn from Random(s + i): seeds 0 and 250 with 300 train problems share 50 streams
    with pytest.raises(rgym.SplitOverlap, match="SPLIT_OVERLAP"):
        opts(eval_seed=250).resolved()
    with pytest.raises(TaskSourceError, match="SPLIT_OVERLAP"):
        open_source("reasoning_gym:chain_sum", generator=opts(eval_seed=250))
    opts(eval_seed=300).resolved()  # adjacent, not overlapping


def test_the_same_dataset_params_and_seed_regenerate_the_same_records():
    a = open_source("reasoning_gym:chain_sum", seed=3, generator=opts())
    b = open_source("reasoning_gym:chain_sum", seed=3, generator=opts())
    first = [next(a) for _ in range(50)]
    assert first == [next(b) for _ in range(50)]
    assert questions(open_source("reasoning_gym:chain_sum", seed=3, generator=opts(seed=5000)), 50) != \
        [json.loads(p.columns)["prompt"] for p in first]
    evals = open_source("reasoning_gym:chain_sum", generator=opts(), split="eval")
    assert questions(evals, 60) == [e["question"] for e in rgym.splits("chain_sum", opts())[1]]  # in order


def test_reward_is_the_datasets_score_answer_on_the_answer_tag_text():
    p = next(open_source("reasoning_gym:chain_sum", generator=opts()))
    wrong = str(int(p.answer) + 1)
    got = score_group(p, [f"thinking...<answer>{p.answer}</answer>", f"<answer>{wrong}</answer>", p.answer,
                          f"<answer>{wrong}</answer> then <answer> {p.answer} </answer>"], [[1]] * 4)
    assert got.rewards == [1.0, 0.0, 0.0, 1.0]  # tags required; the last tag counts
    raw = next(open_source("reasoning_gym:chain_sum", generator=opts(extractor="raw")))
    assert score_group(raw, [f" {raw.answer}\n"], [[1]]).rewards == [1.0]
    last = next(open_source("reasoning_gym:chain_sum", generator=opts(extractor="last_number")))
    wrong = str(int(last.answer) + 1)
    assert score_group(last, [f"{wrong} and so the answer is {last.answer}.", f"{last.answer}, no: {wrong}",
                              "no number"], [[1]] * 3).rewards == [1.0, 0.0, 0.0]


def test_unknown_dataset_and_bad_parameters_fail_at_open():
    with pytest.raises(TaskSourceError, match="not registered"):
        open_source("reasoning_gym:no_such_dataset")
    with pytest.raises(TaskSourceError, match="KEY=VALUE"):
        open_source("reasoning_gym:chain_sum", generator=opts(params=("min_terms",)))


def test_ingest_rescores_and_refuses_a_wrong_claimed_reward():
    tokenizer = tinymodel.build_tokenizer()  # no chat template: the system prompt is put before the question
    source = open_source("reasoning_gym:chain_sum", generator=opts(), system_prompt="reasoning_gym:direct",
                         tokenizer=tokenizer)
    board = TaskBoard(source, lease_timeout_s=60, max_leases_per_client=8)
    ingest = Ingest(identity_public_key=COORD.public_key, run_id="r", board=board, tokenizer=tokenizer,
                    vocab_size=len(tokenizer), current_version=lambda: 0, max_batch_bytes=1 << 20, window_s=300,
                    sampling=SAMPLING)

    def batch(claims) -> bytes:
        lease = board.lease(ALICE.public_key, 1)[0]
        right, wrong = f"<answer>{lease.prompt.answer}</answer>", f"<answer>{int(lease.prompt.answer) + 1}</answer>"
        comps = []
        for text, claim in zip((right, wrong), claims):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            comps.append(messages.Completion(np.asarray(ids, "<i4").tobytes(), np.full(len(ids), -1.0, "<f4").tobytes(),
                                             claim, "length"))
        group = messages.RolloutGroup(lease.lease_id, lease.prompt.prompt_id,
                                      np.asarray(encode_prompt(tokenizer, lease.prompt.text), "<i4").tobytes(),
                                      tuple(comps))
        b = messages.RolloutBatch(run_id="r", adapter_version=0, client_name="alice", sampling=SAMPLING,
                                  groups=(group,), generated_at=0.0)
        return envelope.seal(ALICE, "rollout_batch", messages.encode(b), audience=COORD.public_key)

    ack = ingest.handle(batch((1.0, 0.0)))  # honest claims
    assert ack.accepted and ack.code is None
    ack = ingest.handle(batch((1.0, 1.0)))  # the wrong answer claims full reward
    assert not ack.accepted and ack.code == "REWARD_MISMATCH"


def test_config_and_flags_carry_the_generator_settings(capsys):
    from asyncrl.coordinator import cli

    argv = ["run", "--dry-run", "--model", "tiny", "--task", "reasoning_gym:chain_sum", "--task-param", "min_terms=2",
            "--task-param", "max_digits=2", "--task-size", "500", "--task-eval-seed", "9000"]
    assert cli.main(argv) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["task_params"] == ["min_terms=2", "max_digits=2"] and cfg["task_size"] == 500
    assert cfg["task_eval_seed"] == 9000
    assert cli.main(argv[:-1] + ["400"]) == 2  # eval seeds 400.. meet the train seeds 0..499
    assert "SPLIT_OVERLAP" in capsys.readouterr().err
