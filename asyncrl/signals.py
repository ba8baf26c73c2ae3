"""Signal handlers that only act in the process that installed them.

hivemind.DHT forks. A forked child inherits Python-level signal handlers, so without this guard the
DHT child would treat the SIGTERM hivemind sends it at shutdown as "please stop gracefully" (setting
an Event nobody in that child reads) and never exit — and the parent would hang joining it at exit.
In any other process the guarded handler restores the default action and re-delivers the signal.
"""

from __future__ import annotations

import os
import signal
from typing import Callable


def install(handler: Callable[[int], None], signals=(signal.SIGTERM, signal.SIGINT)) -> None:
    owner = os.getpid()

    def guarded(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        handler(signum)

    for sig in signals:
        signal.signal(sig, guarded)
