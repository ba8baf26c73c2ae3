"""`asyncrl demo` without processes: an earlier run in --run-dir is never deleted unasked (--overwrite
replaces it), and a refused start starts nothing. The signal handling runs for real in
tests/integration/test_demo.py."""

from __future__ import annotations

import signal

import pytest

from asyncrl import cli
from asyncrl.demo import EXIT_USAGE, MARKER, RunDirInUse, prepare_run_dir, record_coordinator_key


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


def earlier_demo(tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(run, overwrite=False)
    (run / "client-0").mkdir()
    (run / "config.json").write_text('{"model": "tiny", "run_dir": "run"}')
    (run / "coordinator.key").write_bytes(b"k" * 32)
    record_coordinator_key(run)
    (run / "metrics.jsonl").write_text('{"event": "step"}\n')
    return run


def test_overwrite_replaces_an_earlier_demo_and_a_new_or_empty_dir_needs_nothing(tmp_path):
    run = earlier_demo(tmp_path)
    prepare_run_dir(run, overwrite=True)
    assert run.is_dir() and [p.name for p in run.iterdir()] == [MARKER]
    prepare_run_dir(tmp_path / "empty", overwrite=False)  # empty: fine
    prepare_run_dir(tmp_path / "new" / "run", overwrite=False)
    assert (tmp_path / "new" / "run").is_dir()


def test_overwrite_never_deletes_what_the_demo_did_not_create(tmp_path):
    real = earlier_run(tmp_path)  # a real run's directory: no demo marker
    (real / "coordinator.key").write_bytes(b"r" * 32)
    with pytest.raises(RunDirInUse, match="not created by the demo"):
        prepare_run_dir(real, overwrite=True)
    assert (real / "coordinator.key").read_bytes() == b"r" * 32
    demo = earlier_demo(tmp_path / "d")
    (demo / "coordinator.key").write_bytes(b"x" * 32)  # a real coordinator started later in the demo's dir
    with pytest.raises(RunDirInUse, match="coordinator key the demo did not write"):
        prepare_run_dir(demo, overwrite=True)
    assert (demo / "coordinator.key").read_bytes() == b"x" * 32 and (demo / "metrics.jsonl").exists()


def test_overwrite_never_deletes_a_real_run_started_later_in_the_demos_directory(tmp_path):
    """`asyncrl-coordinator run --run-dir <the demo's dir>` reuses the demo's key and rewrites config.json: its
    checkpoints are a real run's, and the next demo must not delete them."""
    demo = earlier_demo(tmp_path)
    (demo / "config.json").write_text('{"model": "Qwen/Qwen2.5-0.5B-Instruct", "run_dir": "run"}')
    (demo / "checkpoints").mkdir()
    with pytest.raises(RunDirInUse, match="a run the demo did not start"):
        prepare_run_dir(demo, overwrite=True)
    assert (demo / "checkpoints").is_dir() and (demo / "coordinator.key").read_bytes() == b"k" * 32


def test_the_command_refuses_with_a_usage_status_and_starts_nothing(tmp_path):
    run = earlier_run(tmp_path)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["demo", "--run-dir", str(run), "--steps", "1"]) == EXIT_USAGE
    assert sorted(p.name for p in run.iterdir()) == ["client-0", "metrics.jsonl"]  # no demo.pids, no logs
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
