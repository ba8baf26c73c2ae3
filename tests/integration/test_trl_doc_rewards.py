"""TRL's documented reward functions, verbatim (tests/trl_doc_rewards: Examples 1-6 of TRL's "Using a custom
reward function", registered through the `asyncrl.rewards` entry points of an installed distribution), train
unchanged in a tiny-model swarm: a chat-templated model, plain records with `ground_truth` and `task` columns
scored by Examples 1, 1.1, 3, 4 (both functions: None where not applicable), 5 (async) and 6 (log_extra /
log_metric), conversational records scored by Example 2 (message completions) + 1 + 5. Every step's event
carries TRL's `rewards/<name>/mean|std`, and completions.jsonl the sampled completions with their rewards.
A volunteer without the package is refused at the handshake with the install line before any lease. The unit
tests in tests/tasks/test_trl_doc_examples.py call the same functions directly."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.conftest import REPO, wait_for_join
from tests.harness import volunteer_args

pytestmark = pytest.mark.integration

PKG = REPO / "tests" / "trl_doc_rewards"
PLAIN = "trl_reference+trl_math_task+trl_coding_task+trl_logging+0.01*trl_token_length+0.01*trl_char_length+trl_async"
CHAT = "trl_format+0.01*trl_token_length+trl_async"
NAMES = {"trl_token_length", "trl_char_length", "trl_format", "trl_reference", "trl_math_task", "trl_coding_task",
         "trl_async", "trl_logging"}
STEPS, PROMPTS = 3, 3  # one lease = one batch = one step = one pass over the 3 records


def records():
    return [{"prompt": "what is 2+2? answer in boxed", "ground_truth": "4", "task": "math", "reward": PLAIN},
            {"prompt": "write def add", "ground_truth": "x", "task": "coding", "reward": PLAIN},
            {"prompt": [{"role": "system", "content": "think first"}, {"role": "user", "content": "hi"}],
             "reward": CHAT}]


def test_trl_documented_rewards_train_unchanged_with_per_reward_metrics(procs, tmp_path):
    from asyncrl.models.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "model", instruct=True)
    task = tmp_path / "mixed.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in records()))
    run = tmp_path / "run"
    (tmp_path / "coordinator.toml").write_text(textwrap.dedent(f"""
        run_id = "trl-docs"
        model = "{model}"
        run_dir = "{run}"
        task = "{task}"
        max_new_tokens = 8
        lr = 2e-3
        group_size = 4
        prompts_per_lease = {PROMPTS}
        groups_per_step = {PROMPTS}
        min_groups = {PROMPTS}
        max_steps = {STEPS}
        log_completions_every = 1
        log_completions_count = 3
        dashboard = false
    """))
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(PKG)])}
    # everything but the thread count from the TOML above (run directory, model, steps, no dashboard), so not
    # coordinator_args, which names the run directory and the harness defaults on the command line
    coord = procs.start("coordinator", ["-m", "asyncrl.coordinator.cli", "run", "--config",
                                        str(tmp_path / "coordinator.toml"), "--threads", "1"], env=env)
    join = wait_for_join(run, 240, proc=coord)
    # A volunteer without the reward package (PYTHONPATH without it) is refused at the handshake with the install
    # line, before it asks for a lease; the coordinator records the refusal for the operator (no strike).
    bare = procs.start("bare", volunteer_args(join, tmp_path / "bare", name="bare"), env={"PYTHONPATH": str(REPO)})
    assert bare.wait(180) != 0
    assert "REWARD_PACKAGE_MISSING" in bare.log_path.read_text()
    assert "pip install 'trl-doc-rewards==1.17.0'" in bare.log_path.read_text()
    vol = procs.start("volunteer", volunteer_args(join, tmp_path / "vol", name="trl", prompts_per_batch=PROMPTS,
                                                  fixed_lease_size=True), env=env)
    assert coord.wait(400) == 0, coord.log_path.read_text()[-3000:]
    vol.wait(120)
    status = json.loads((tmp_path / "vol" / "status.json").read_text())
    refused = {code: n for code, n in status["batches_rejected"].items() if code != "RUN_FINISHED"}  # sent after the end
    assert status["reward_errors"] == 0 and refused == {}, status

    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == STEPS and summary["rejected_by_client"] == {}
    events = list(map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))
    refused = [e for e in events if e["event"] == "handshake_refused"]
    assert [e["code"] for e in refused] == ["REWARD_PACKAGE_MISSING"] and "pip install" in refused[0]["detail"]
    assert set(summary["batches_by_client"]) == {"trl"}  # the refused one never worked
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == STEPS
    logged = {k.split("/")[1] for s in steps for k in s if k.startswith("rewards/") and k.endswith("/mean")}
    assert logged == NAMES  # every documented function scored something, each under its own name
    for s in steps:
        for name in {k.split("/")[1] for k in s if k.startswith("rewards/")}:
            assert s[f"rewards/{name}/std"] >= 0
        assert 1.0 <= s["rewards/trl_token_length/mean"] <= 8.0  # Example 1: tokens per completion, cap 8
        for name in ("trl_format", "trl_reference", "trl_logging", "trl_async"):  # 0/1 rewards
            if f"rewards/{name}/mean" in s:
                assert 0.0 <= s[f"rewards/{name}/mean"] <= 1.0
        for name in ("trl_math_task", "trl_coding_task"):  # +-1 where applicable, None elsewhere
            if f"rewards/{name}/mean" in s:
                assert -1.0 <= s[f"rewards/{name}/mean"] <= 1.0
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1)) and all(len(r["rewards"]) >= 3 for r in rows)
    for r in rows:  # the logged total is the weighted TRL nansum of the logged per-function values
        spec = CHAT if "trl_format" in r["rewards"] else PLAIN
        weights = {t.split("*")[-1]: float(t.split("*")[0]) if "*" in t else 1.0 for t in spec.split("+")}
        total = sum(weights[n] * v for n, v in r["rewards"].items() if v is not None)
        assert abs(total - r["reward"]) < 1e-6, r
