"""The client's CLI fails with one readable line, never a traceback."""

import subprocess
import sys

PEER = "12D3KooWCTPoZcmRwD9Wv1yMmMqnmYb8gQiyGtf68YLDZ3iRuz7o"


def run_client(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "asyncrl.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_malformed_address_is_one_line_error():
    r = run_client("join", "not-an-address")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "not a multiaddr" in r.stderr


def test_address_without_peer_id_is_refused():
    r = run_client("join", "/ip4/127.0.0.1/tcp/4001")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "/p2p/" in r.stderr


def test_closed_port_is_one_line_error(free_port):
    r = run_client("join", f"/ip4/127.0.0.1/tcp/{free_port}/p2p/{PEER}")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "cannot reach" in r.stderr


def test_overlong_name_is_refused_before_anything_starts():
    r = run_client("join", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", "--name", "n" * 65)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--name" in r.stderr


def test_help_imports_nothing_heavy():
    """`--help` answers without torch, hivemind or transformers (what made it slow); how fast that is on a
    given machine is a benchmark's business, not a unit test's."""
    r = run_client("--help")
    assert r.returncode == 0 and "join" in r.stdout
    heavy = subprocess.run([sys.executable, "-c", "import sys; import asyncrl.client.cli; "
                            "print(sorted(m for m in ('torch','hivemind','transformers') if m in sys.modules))"],
                           capture_output=True, text=True)
    assert heavy.stdout.strip() == "[]"
