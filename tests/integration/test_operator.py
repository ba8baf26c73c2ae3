"""Operator experience end to end: a coordinator started from the example config file, two volunteers
started from the join command it printed (as is), then /metrics, `status`, the dashboard in a real
headless Chromium, SIGUSR1 plots, and a clean SIGTERM. One swarm serves the whole module; the tests
run in file order and the last one stops it.

Chromium is Debian's (`make test` installs chromium + chromium-driver); a missing browser is a
failure, never a skip. The screenshot lands in tests/artifacts/dashboard.png.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.coordinator.config_file import EXAMPLE_PATH

from tests.conftest import REPO, Procs, wait_for
from tests.harness import coordinator_args

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = REPO / "tests" / "artifacts"
VOLUNTEERS = ("vol-0", "vol-<i>1</i>")  # the second name must show as text, never as markup


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text()[-n:] if path.exists() else "(no log)"


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read()


class Swarm:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs = Procs(tmp)
        self.run = tmp / "run"

    def status(self) -> dict:
        return json.loads(http_get(self.url + "api/status"))

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{_tail(p.log_path)}" for p in self.procs.procs)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = Swarm(tmp_path_factory.mktemp("operator"))
    try:
        # The example file is a real-model config (every field at its default); flags swap in the tiny model
        # and the toy length its 256-token context needs. With its dashboard; waited for on the join command it
        # prints, which the volunteers below run as is.
        s.coord = s.procs.start("coordinator", coordinator_args(
            s.run, config=REPO / EXAMPLE_PATH, no_dashboard=False, max_new_tokens=8, groups_per_step=4, max_wait_s=2))

        def printed_join():
            if s.coord.poll() is not None:
                pytest.fail("the coordinator exited:\n" + s.logs())
            m = re.search(r"^\s*(asyncrl-client join \S+)\s*$", _tail(s.coord.log_path, 100000), re.M)
            return m and m.group(1)

        s.join_command = wait_for(printed_join, 180, "the printed join command")
        s.url = wait_for(lambda: (s.run / "dashboard.txt").exists() and (s.run / "dashboard.txt").read_text().strip(),
                         60, "dashboard.txt")
        argv = shlex.split(s.join_command)  # exactly what the operator copies
        script = Path(sys.executable).parent / argv[0]
        for i, name in enumerate(VOLUNTEERS):
            s.procs.start(f"client-{i}", [str(script), *argv[1:], "--name", name, "--data-dir", str(s.tmp / f"c{i}"),
                                          "--seed", str(i), "--threads", "1"])

        def both_trained():
            vols = s.status()["volunteers"]
            return (len(vols) == 2 and all(v["lag"] is not None and v["accepted"] >= 1 for v in vols)
                    and s.status()["learner"]["steps"] >= 2 and vols)

        try:
            s.names = {v["name"] for v in wait_for(both_trained, 400, "both volunteers' batches to be trained on")}
        except AssertionError:
            pytest.fail("swarm did not get going:\n" + s.logs())
        yield s
    finally:
        s.procs.reap()


def test_join_command_is_accepted_as_is_and_fingerprint_is_printed(swarm):
    from asyncrl.protocol.identity import Identity

    ident = Identity.load(swarm.run / "coordinator.key")
    log = _tail(swarm.coord.log_path, 100000)
    assert ident.fingerprint in log
    assert swarm.join_command.endswith("/p2p/" + ident.peer_id)
    assert len(swarm.names) == 2
    assert all(v["accepted"] >= 1 for v in swarm.status()["volunteers"])
    resolved = json.loads((swarm.run / "config.json").read_text())
    assert resolved["max_steps"] == 0 and resolved["groups_per_step"] == 4  # flags over the file


def test_metrics_endpoint_serves_learner_and_swarm_metrics(swarm):
    samples = {}
    for fam in text_string_to_metric_families(http_get(swarm.url + "metrics").decode()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("asyncrl_learner_steps_total", ())] >= 2
    assert samples[("asyncrl_adapter_version", ())] >= 1
    assert samples[("asyncrl_adapter_publish_bytes_total", (("kind", "compressed"),))] > 0
    assert ("asyncrl_learner_reward_mean", ()) in samples and ("asyncrl_learner_loss", ()) in samples
    assert samples[("asyncrl_learner_staleness_versions_count", ())] >= 2
    assert 0.0 < samples[("asyncrl_learner_is_ess", ())] <= 1.0  # real volunteers' batches, real IS weights
    assert 0.0 <= samples[("asyncrl_learner_masked_fraction", ())] <= 1.0
    assert samples[("asyncrl_swarm_batches_accepted_total", ())] >= 2
    assert samples[("asyncrl_swarm_rollouts_total", ())] > 0
    assert samples[("asyncrl_swarm_volunteers", (("state", "known"),))] == 2
    lags = [k for k in samples if k[0] == "asyncrl_swarm_volunteer_version_lag"]
    assert len(lags) == 2


def test_status_command_reads_the_running_coordinator(swarm):
    cli = [sys.executable, "-m", "asyncrl.coordinator.cli", "status", "--run-dir", str(swarm.run)]
    done = subprocess.run(cli + ["--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {v["name"] for v in json.loads(done.stdout)["volunteers"]} == swarm.names
    assert subprocess.run(cli, capture_output=True, text=True, timeout=120).returncode == 0


def test_no_key_material_is_served(swarm):
    pem = (swarm.run / "coordinator.key").read_text()
    secret = "".join(line for line in pem.splitlines() if "-----" not in line)
    seed = (swarm.run / "p2p.identity").read_bytes()[4:36].hex()
    for path in ("", "api/status", "metrics"):
        body = http_get(swarm.url + path).decode()
        assert secret not in body and seed not in body and "PRIVATE KEY" not in body


def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never try to download a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={tempfile.mkdtemp(prefix='asyncrl-chromium-')}",
                "--window-size=1400,1150"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


# The page re-renders its tables on every poll (replaceChildren), so an element found in one poll is
# stale in the next (CI, 0903ed2: StaleElementReferenceException on a contributors row). Every read is
# one snapshot taken by a script, which the page's single thread runs between two renders.
_SNAPSHOT_JS = """
const rows = (sel, key) => [...document.querySelectorAll(sel)].map(
  (tr) => ({key: tr.getAttribute(key), cells: [...tr.querySelectorAll("td")].map((td) => td.innerText.trim())}));
const text = (id) => document.getElementById(id).innerText.trim();
const count = (sel) => document.querySelectorAll(sel).length;
return {
  swarm: rows("#swarm tbody tr[data-volunteer]", "data-volunteer"),
  contributors: rows("#contributors tbody tr[data-contributor]", "data-contributor"),
  markup: count("#swarm tbody i, #swarm tbody b"),
  version: text("version"), ess: text("ess"), join: text("join"),
  reward_lines: count("#reward_chart polyline"),
  staleness_lines: count("#staleness_chart polyline"),
  offpolicy_lines: count("#offpolicy_chart polyline"),
};
"""


def test_dashboard_in_headless_chromium(swarm):
    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), \
        "Debian's chromium and chromium-driver are missing: `make test` installs them (apt-get)"
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium()
    try:
        driver.get(swarm.url)

        def ready(d):
            """A rendered state with both volunteers (lag shown), both contributors and the reward chart."""
            snap = d.execute_script(_SNAPSHOT_JS)
            lags = [r["cells"][3] for r in snap["swarm"]]
            return (len(snap["swarm"]) == 2 and all(lag.isdigit() for lag in lags)
                    and len(snap["contributors"]) == 2 and snap["reward_lines"] > 0 and snap)

        snap = WebDriverWait(driver, 180, poll_frequency=0.5).until(ready)
        status = {v["name"]: v for v in swarm.status()["volunteers"]}
        assert {r["key"] for r in snap["swarm"]} == swarm.names
        for row in snap["swarm"]:
            cells = row["cells"]
            assert cells[0] == row["key"]                          # shown as text, exactly as reported
            assert cells[1] == status[row["key"]]["fingerprint"]
            assert re.fullmatch(r"v\d+", cells[2])                 # version held
            assert int(cells[3]) >= 0                               # lag
        assert snap["markup"] == 0                                  # no injected markup
        fingerprints = {v["fingerprint"] for v in status.values()}
        assert {r["key"] for r in snap["contributors"]} == fingerprints  # one row per key
        assert all(int(r["cells"][3]) > 0 for r in snap["contributors"])  # accepted tokens
        assert re.fullmatch(r"v\d+", snap["version"])
        assert snap["staleness_lines"] > 0
        assert snap["offpolicy_lines"] == 2                         # ESS, masked
        assert 0.0 < float(snap["ess"]) <= 1.0
        assert snap["join"] == swarm.join_command
        ARTIFACTS.mkdir(exist_ok=True)
        assert driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    finally:
        driver.quit()
    assert (ARTIFACTS / "dashboard.png").read_bytes().startswith(b"\x89PNG")


def test_sigusr1_writes_the_plot(swarm):
    plot = swarm.run / "reward.png"
    assert not plot.exists()
    os.kill(swarm.coord.pid, signal.SIGUSR1)  # the coordinator only: its DHT child keeps the default action
    wait_for(plot.exists, 120, "reward.png after SIGUSR1")
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_sigterm_stops_cleanly_with_a_final_plot(swarm):
    plot = swarm.run / "reward.png"
    before = plot.stat().st_mtime_ns if plot.exists() else None  # SIGUSR1's plot, when that test ran first
    os.kill(swarm.coord.pid, signal.SIGTERM)
    try:
        swarm.coord.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("coordinator did not stop on SIGTERM:\n" + _tail(swarm.coord.log_path))
    assert swarm.coord.returncode == 0, _tail(swarm.coord.log_path)
    assert plot.read_bytes().startswith(b"\x89PNG") and (before is None or plot.stat().st_mtime_ns > before)
    assert (swarm.run / "summary.json").exists()
    assert not (swarm.run / "dashboard.txt").exists()
