"""`asyncrl demo` without processes: an earlier run in --run-dir is never deleted unasked (--overwrite
replaces it), and a refused start starts nothing. The signal handling runs for real in
tests/integration/test_demo.py."""

from __future__ import annotations

import signal

import pytest

from asyncrl import cli
from asyncrl.demo import EXIT_USAGE, RunDirInUse, prepare_run_dir


def earlier_run(tmp_path):
    run = tmp_path / "run"
    (run / "client-0").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "step"}\n')
    return run


def test_an_earlier_run_is_refused_and_kept(tmp_path):
    run = earlier_run(tmp_path)
    with pytest.raises(RunDirInUse):
        prepare_run_dir(run, overwrite=False)
    assert (run / "metrics.jsonl").read_text() == '{"event": "step"}\n'
    with pytest.raises(RunDirInUse):  # a file where the directory should be
        prepare_run_dir(run / "metrics.jsonl", overwrite=True)


def test_overwrite_replaces_it_and_a_new_or_empty_dir_needs_nothing(tmp_path):
    run = earlier_run(tmp_path)
    prepare_run_dir(run, overwrite=True)
    assert run.is_dir() and not any(run.iterdir())
    prepare_run_dir(run, overwrite=False)  # empty: fine
    prepare_run_dir(tmp_path / "new" / "run", overwrite=False)
    assert (tmp_path / "new" / "run").is_dir()


def test_the_command_refuses_with_a_usage_status_and_starts_nothing(tmp_path):
    run = earlier_run(tmp_path)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["demo", "--run-dir", str(run), "--steps", "1"]) == EXIT_USAGE
    assert sorted(p.name for p in run.iterdir()) == ["client-0", "metrics.jsonl"]  # no demo.pids, no logs
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
