"""`kvflow serve` under test, logging into a folder of its own: serve.log (the router and launcher) and workers/
(one log per worker), so a scenario can start several clusters in one working folder.

Invariant: every cluster gets a fresh folder under the scenario's; nothing is written outside it."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

from kvflow.benchmarks.server import ServerProcess


def kvflow_serve(work: Path, *flags: str, env: dict[str, str] | None = None,
                 stop_signal: int = signal.SIGTERM) -> ServerProcess:
    own = Path(tempfile.mkdtemp(prefix="serve-", dir=work))
    return ServerProcess.kvflow("serve", *flags, "--log-dir", str(own / "workers"), "--disable-log-requests",
                                env=env, log_path=own / "serve.log", stop_signal=stop_signal)

