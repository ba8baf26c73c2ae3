"""asyncrl.protocol must stay pure: importing it (all submodules) pulls in no heavy ML/network stack."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

FORBIDDEN = ("torch", "hivemind", "vllm", "transformers")
SUBMODULES = ["errors", "limits", "identity", "messages", "envelope", "codec", "codec.format", "codec.planes",
              "codec.encoder", "codec.decoder", "codec.chunking", "swarm", "atomic"]


def test_protocol_imports_no_heavy_dependencies():
    present = [m for m in SUBMODULES if importlib.util.find_spec(f"asyncrl.protocol.{m}") is not None]
    assert {"errors", "limits", "identity", "messages", "envelope"} <= set(present)
    code = (
        "import importlib, json, sys\n"
        "import asyncrl.protocol\n"
        f"for m in {present!r}: importlib.import_module('asyncrl.protocol.' + m)\n"
        f"print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
