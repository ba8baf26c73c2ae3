"""What every benchmark's JSON carries besides its figures, and how it is written (`--json-out PATH`).

`provenance()`: the machine (CPUs, 1-minute load average when the figures were taken), the date and
the exact command — so a figure is never read without the load it was measured under.
`write_result(path, result)`: atomic JSON (asyncrl.protocol.atomic), parent directories created.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from asyncrl.protocol.atomic import write_atomic

REPO = Path(__file__).resolve().parents[1]


def provenance() -> dict:
    return {"machine": {"cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])}


def write_result(path: str | None, result: dict) -> None:
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(result, indent=2))
