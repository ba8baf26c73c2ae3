"""The run log (asyncrl/runlog.py): what the coordinator writes, every reader reads the same way."""

from __future__ import annotations

import json

from asyncrl.runlog import METRICS_FILE, RunLog, read_events


def test_written_events_read_back_in_order_with_their_fields(tmp_path):
    seen = []
    log = RunLog(tmp_path / METRICS_FILE, listeners=[lambda event, record: seen.append(record)])
    log.write("publish", version=1)
    log.write("step", step=1, reward_mean=0.25)
    log.write("step", step=2, reward_mean=0.5)
    log.close()
    events = read_events(tmp_path)  # the run directory or the file itself
    assert [e["event"] for e in events] == ["publish", "step", "step"]
    assert events == seen and events == read_events(tmp_path / METRICS_FILE)
    assert [e["step"] for e in read_events(tmp_path, "step")] == [1, 2]
    assert all(isinstance(e["t"], float) for e in events)


def test_a_line_still_being_written_is_not_read_and_is_read_once_complete(tmp_path):
    path = tmp_path / METRICS_FILE
    whole = json.dumps({"event": "step", "step": 7})
    path.write_text(json.dumps({"event": "publish", "version": 3}) + "\n" + whole[:11])
    assert [e["event"] for e in read_events(path)] == ["publish"]
    assert read_events(path).skipped == 0  # being written is not damage
    with open(path, "a") as f:
        f.write(whole[11:] + "\n")
    assert [e.get("step") for e in read_events(path, "step")] == [7]


def test_a_damaged_complete_line_is_skipped_and_counted_and_later_events_still_read(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"event": "step", "step": 1}\n{"event": "st\n[1, 2]\n{"no_event": 1}\n{"event": "step", "step": 2}\n')
    events = read_events(path, "step")
    assert [e["step"] for e in events] == [1, 2]
    assert events.skipped == 3


def test_a_run_directory_without_a_log_reads_as_no_events(tmp_path):
    assert read_events(tmp_path) == [] and read_events(tmp_path / "nowhere" / METRICS_FILE) == []
