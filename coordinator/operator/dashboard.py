"""Dashboard: the coordinator's read-only HTTP surface (starlette app served by uvicorn on a thread).

Routes (GET only; nothing here can change the run):
  /             the status page (coordinator/operator/dashboard_page.py: one self-contained HTML file, no CDN;
                its script polls /api/status and draws tables and inline-SVG curves)
  /api/status   the Coordinator's `snapshot()` as JSON: public facts only, never key material
  /metrics      Prometheus text exposition (coordinator/operator/metrics.py)
  /plot.png     redraws <run_dir>/reward.png from metrics.jsonl (at most every PLOT_MIN_INTERVAL_S)
                and returns it

Bound to 127.0.0.1 by default (`dashboard_host`); when bound to loopback a Host-header check refuses
other names, so a web page elsewhere cannot read it through DNS rebinding. Port 0 picks a free port;
the URL lands in <run_dir>/dashboard.txt (atomically) for `asyncrl-coordinator status` and tests.
We bind the socket ourselves and hand it to uvicorn, so the port is known before the thread starts.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from asyncrl.protocol.atomic import write_atomic

PLOT_MIN_INTERVAL_S = 5.0
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def build_app(*, snapshot: Callable[[], dict], registry, plot: Callable[[], Path | None],
              allowed_hosts: list[str] | None):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    from .dashboard_page import PAGE

    def page(request):
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})

    def status(request):  # sync endpoints run in starlette's thread pool, off the server loop
        return JSONResponse(snapshot(), headers={"Cache-Control": "no-store"})

    def metrics(request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def plot_png(request):
        path = plot()
        if path is None:
            return JSONResponse({"error": "no optimizer step logged yet"}, status_code=404)
        return Response(path.read_bytes(), media_type="image/png", headers={"Cache-Control": "no-store"})

    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)] if allowed_hosts else []
    routes = [Route("/", page), Route("/api/status", status), Route("/metrics", metrics),
              Route("/plot.png", plot_png)]
    return Starlette(routes=routes, middleware=middleware)


class ThrottledPlot:
    """Redraw the run's plot at most every `min_interval_s`; otherwise hand back the last one."""

    def __init__(self, run_dir: Path, min_interval_s: float = PLOT_MIN_INTERVAL_S):
        self.run_dir = Path(run_dir)
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last = 0.0
        self._path: Path | None = None

    def __call__(self) -> Path | None:
        from .plots import plot_run

        with self._lock:
            if self._path is None or time.monotonic() - self._last >= self.min_interval_s:
                self._path = plot_run(self.run_dir)
                self._last = time.monotonic()
            return self._path


class Dashboard:
    def __init__(self, *, snapshot: Callable[[], dict], registry, run_dir: Path, host: str = "127.0.0.1",
                 port: int = 0):
        self.run_dir = Path(run_dir)
        self.host, self.port = host, port
        allowed = LOOPBACK_NAMES if is_loopback(host) else None
        self.app = build_app(snapshot=snapshot, registry=registry, plot=ThrottledPlot(self.run_dir),
                             allowed_hosts=allowed)
        self.url: str | None = None
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, loop="asyncio", http="h11", lifespan="off", log_level="warning",
                                access_log=False, server_header=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="dashboard",
                                        daemon=True)
        self._thread.start()
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host == "::" else self.host)
        shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
        self.url = f"http://{shown}:{self.port}/"
        write_atomic(self.run_dir / "dashboard.txt", self.url + "\n")
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            (self.run_dir / "dashboard.txt").unlink()
        except FileNotFoundError:
            pass


def fetch_status(url: str, timeout: float = 5.0) -> dict:
    """GET <url>/api/status (used by `asyncrl-coordinator status`)."""
    from urllib.request import urlopen

    with urlopen(url.rstrip("/") + "/api/status", timeout=timeout) as resp:
        return json.loads(resp.read())
