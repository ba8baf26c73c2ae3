"""The doctor's local rows and verdict from probe results (no network, no GPU needed)."""

from __future__ import annotations

import argparse

from asyncrl.client import checks, doctor
from asyncrl.client.cli import build_parser
from asyncrl.protocol import handshake

GiB = 1 << 30


def args(*extra) -> argparse.Namespace:
    return build_parser().parse_args(["doctor", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWx", *extra])


def gpu_probe(total_gib: float, free_gib: float, params: int) -> dict:
    return {"cuda": True, "gpus": [{"name": "RTX", "total_bytes": int(total_gib * GiB), "free_bytes": int(free_gib * GiB)}],
            "model": {"ref": "m", "params": params}, "memory": {}}


def test_doctor_takes_every_join_flag():
    join = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["join"]._actions}
    doc = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["doctor"]._actions}
    assert join - {"quiet", "json_logs", "follow"} <= doc


def test_memory_row_against_the_base_model():
    seven_b = 7_600_000_000
    assert doctor._memory_row(gpu_probe(16, 15, seven_b), args()).status == checks.FAIL  # 7B bf16 + KV > 13.6 GiB lent
    assert doctor._memory_row(gpu_probe(24, 23, seven_b), args()).status == checks.PASS  # docs: a 7B wants 24 GB
    assert doctor._memory_row(gpu_probe(80, 79, seven_b), args()).status == checks.PASS
    assert doctor._memory_row(gpu_probe(80, 10, seven_b), args()).status == checks.WARN  # someone else holds it now
    assert doctor._memory_row({"cuda": False, "gpus": [], "model": {"ref": "tiny", "params": 300_000},
                               "memory": {"MemTotal": 8 * GiB, "MemAvailable": 4 * GiB}}, args()).status == checks.PASS
    assert doctor._memory_row({"cuda": False, "gpus": [], "model": {"ref": "m", "params": seven_b},
                               "memory": {"MemTotal": 16 * GiB, "MemAvailable": 8 * GiB}}, args()).status == checks.FAIL
    assert doctor._memory_row({"model": {"ref": "m", "error": "not cached"}}, args()).status == checks.WARN


def test_engine_row():
    ok = {"requested": "auto", "chosen": "transformers", "reason": "no CUDA device visible", "ok": True, "version": "5"}
    assert doctor._engine_row(ok, "auto").status == checks.PASS
    broken = {"requested": "vllm", "chosen": "vllm", "reason": "", "ok": False, "error": "ImportError: libcudart"}
    row = doctor._engine_row(broken, "vllm")
    assert row.status == checks.FAIL and row.fix


def test_disk_row_fails_when_nothing_fits(tmp_path):
    assert doctor._disk_row(args("--data-dir", str(tmp_path)), {}, None).status in (checks.PASS, checks.WARN)
    huge = doctor._disk_row(args("--data-dir", str(tmp_path)), {"params": 10**15}, "org/not-cached-model")
    assert huge.status == checks.FAIL


def hs(offset: float) -> checks.Handshake:
    info = handshake.CoordinatorInfo(run_id="r", asyncrl_version="0.2.0", protocol=1, schema=handshake.SCHEMA_VERSION,
                                     time=0.0, window_s=300.0)
    return checks.Handshake(info, offset, 0.01)


def test_clock_row_thresholds():
    assert checks.clock_check(hs(0.5)).status == checks.PASS
    assert checks.clock_check(hs(-10)).status == checks.WARN  # beyond the DHT's 3 s
    row = checks.clock_check(hs(400))
    assert row.status == checks.FAIL and row.code == "EXPIRED"
    assert checks.clock_check(None).status == checks.SKIP


def test_exit_status_only_when_join_would_work():
    ok = [checks.Check(r, checks.PASS, "") for r in doctor.ORDER]
    assert doctor.exit_status(ok) == 0
    assert doctor.exit_status(ok[:-1] + [checks.Check("clock", checks.WARN, "")]) == 0
    assert doctor.exit_status(ok[:-1] + [checks.Check("clock", checks.SKIP, "")]) == 1
    assert doctor.exit_status(ok[:-1] + [checks.Check("clock", checks.FAIL, "")]) == 1
    assert "fix: do this" in doctor.render([checks.Check("tcp", checks.FAIL, "closed", "do this")])
