"""Run the server under uvicorn until a signal: `loraplex serve` ends here.

SIGTERM (what Kubernetes sends) drains: /ready turns 503 at once so the endpoint leaves the Service,
the listening socket closes, running requests finish (for at most `drain_timeout_s`; then they are
cancelled, which aborts them in the engine), and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:  # the app (FastAPI, the engine, torch) loads in run_server: report_fatal stays light
    from .app import ServerState
    from .settings import ServerSettings

log = logging.getLogger("loraplex.engine.server")

# Kubernetes shows this file's content (at most 4096 bytes) as the container's termination message.
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_BYTES = 4096


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app it is draining as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.draining:
            log.info("signal %d: draining (at most %.0f s)", sig, self.state.settings.drain_timeout_s)
        self.state.draining = True
        # uvicorn's own handler also records the signal to raise it again after shutdown, which would
        # turn a clean drain into death by SIGTERM (exit 143); a drained server exits 0 instead.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True


def run_server(settings: ServerSettings) -> int:
    """Serve until stopped; 0 after a clean drain, 2 if the model or a start adapter failed to load."""
    from .app import create_app

    logging.getLogger("loraplex").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fatal: list[str] = []
    server: DrainingServer | None = None

    def on_fatal(message: str) -> None:
        fatal.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,  # one line per request drowns everything else at serving rates
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
    )
    server = DrainingServer(config, app.state.server)
    server.run()
    if fatal:
        report_fatal(f"loraplex serve: {fatal[0]}")
        return 2
    return 0


def report_fatal(line: str) -> None:
    """Say on stderr, in one line, why `loraplex serve` exits; and where Kubernetes shows it (pod status)."""
    line = " ".join(line.split())
    print(line, file=sys.stderr, flush=True)
    configured = os.environ.get("LORAPLEX_TERMINATION_LOG")
    path = Path(configured or TERMINATION_LOG)
    if not configured and not path.exists():
        return  # not in a Kubernetes container: never create a file under /dev
    try:
        with path.open("w") as log_file:
            log_file.write(line[:TERMINATION_LOG_BYTES] + "\n")
    except OSError:  # read-only or not ours: stderr has said it
        pass
