"""A reward asyncrl cannot call is refused at coordinator start naming the parameter; --dry-run checks the
task file (exists, every record and the rewards it names) without a model or the network."""

from __future__ import annotations

import json

import pytest

from asyncrl import tasks
from asyncrl.coordinator import cli
from asyncrl.tasks.sources import TaskSourceError, open_source


def undeclared(completion, answer):  # the simple form, not declared: TRL would call it with keywords only
    return 1.0


def needs_env(completions, environments, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture
def task(tmp_path, monkeypatch):
    monkeypatch.setitem(tasks.REWARDS, "undeclared", undeclared)
    monkeypatch.setitem(tasks.REWARDS, "needs_env", needs_env)
    path = tmp_path / "t.jsonl"

    def write(reward):
        path.write_text(json.dumps({"prompt": "q", "answer": "a", "reward": reward}) + "\n")
        return path
    return write


@pytest.mark.parametrize("reward, parameter", [("undeclared", "'completion'"), ("needs_env", "'environments'")])
def test_unsupported_signature_is_refused_at_start_naming_the_parameter(task, capsys, reward, parameter):
    path = task(reward)
    assert cli.main(["run", "--dry-run", "--model", "tiny", "--task", str(path)]) == 2
    err = capsys.readouterr().err
    assert parameter in err and f"{path}:1" in err
    with pytest.raises(TaskSourceError, match=parameter):  # the coordinator's own start opens the task the same way
        open_source(str(path))


def test_declared_simple_reward_and_trl_form_start(task, capsys, monkeypatch):
    monkeypatch.setitem(tasks.REWARDS, "undeclared", tasks.simple_reward(undeclared))
    assert cli.main(["run", "--dry-run", "--model", "tiny", "--task", str(task("undeclared"))]) == 0
    assert json.loads(capsys.readouterr().out)["task"].endswith("t.jsonl")


def test_dry_run_fails_for_a_task_file_that_does_not_exist(tmp_path, capsys):
    assert cli.main(["run", "--dry-run", "--task", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_dry_run_checks_a_jsonl_task_without_importing_torch(tmp_path):
    """`run --dry-run` is the check a reader runs first (docs/tasks.md): it validates every record and its
    rewards from the config alone, so it answers without loading torch (as `--help` does)."""
    import subprocess
    import sys

    (tmp_path / "t.jsonl").write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n')
    probe = ("import sys; from asyncrl.coordinator import cli; "
             f"code = cli.main(['run', '--dry-run', '--task', {str(tmp_path / 't.jsonl')!r}]); "
             "print('exit', code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[-1] == "exit 0 False", r.stdout + r.stderr
