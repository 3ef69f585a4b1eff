"""`loraplex up`: the whole platform on one machine.

One engine (`loraplex serve`, SmolLM2-135M-Instruct on the CPU or the GPU) runs as a child process on a
loopback port; the control plane (console, admin and tenant API, gateway) runs in this process on the
one public port, on SQLite under the data dir unless a database URL is given. The demo (a tenant, a
console user, an API key and the trained demo adapter) is created once and reused on every start.
Ctrl-C (or SIGTERM) stops the control plane and then the engine; the engine also dies with this process
if it is killed outright (PR_SET_PDEATHSIG), so nothing it started outlives it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.engine import options
from loraplex.engine.config import ENGINE_OPTIONS

if TYPE_CHECKING:  # the CLI imports this module for every command: the heavy imports wait for `up`
    import uvicorn

    from loraplex.web.bootstrap import Demo
    from loraplex.web.settings import Settings

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[1]
DEMO_ADAPTER_DIR = REPO / "fixtures" / "adapters" / "demo-uppercase"
READY_LINE = "loraplex is up"
# The demo adapter was trained on BASE_MODEL, so `up` always serves that model: no --model.
ENGINE_OPTIONS_FOR_UP = tuple(o for o in ENGINE_OPTIONS if o.name != "model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="the one port for everything (default 8080)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="database, adapters and secrets (default $LORAPLEX_DATA_DIR or ~/.loraplex)",
    )
    parser.add_argument("--database-url", default=None, help="Postgres URL (default: SQLite in the data dir)")
    parser.add_argument(
        "--engine-port", type=int, default=0, help="loopback port of the engine (default: a free one)"
    )
    parser.add_argument(
        "--engine-timeout", type=float, default=600.0, help="seconds to wait for the model to load"
    )
    # The engine's own options, as `loraplex serve` takes them (LORAPLEX_* variables reach it too).
    options.add_arguments(
        parser.add_argument_group("engine options (passed to loraplex serve)"), ENGINE_OPTIONS_FOR_UP
    )


def engine_command(port: int, args: argparse.Namespace) -> list[str]:
    """The engine's command line: `loraplex serve` on a loopback port, with the engine flags given to `up`."""
    command = [sys.executable, "-m", "loraplex.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return [
        *command,
        *options.command_line(ENGINE_OPTIONS_FOR_UP, options.values_given(args, ENGINE_OPTIONS_FOR_UP)),
    ]


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import SecretStr

    from loraplex.web.app import create_app
    from loraplex.web.bootstrap import ensure_demo
    from loraplex.web.db.migrate import upgrade
    from loraplex.web.settings import Settings, secret_in_file

    overrides: dict[str, object] = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir.expanduser().resolve()
    if args.database_url:
        overrides["database_url"] = args.database_url
    # The engine listens on loopback beside the control plane: its endpoint is 127.0.0.1.
    overrides["allow_loopback_endpoints"] = True
    settings = Settings(**overrides)  # type: ignore[arg-type]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.admin_token is None:  # one machine, one operator: the admin API on a kept token
        settings.admin_token = SecretStr(secret_in_file(settings.data_dir / "admin_token"))
    if not DEMO_ADAPTER_DIR.is_dir():
        print(f"loraplex up: the demo adapter is missing ({DEMO_ADAPTER_DIR})", file=sys.stderr)
        return 2
    if _port_taken(args.host, args.port):
        print(
            f"loraplex up: port {args.port} on {args.host} is in use; pick another with --port",
            file=sys.stderr,
        )
        return 2

    engine_port = args.engine_port or _free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    log_path = settings.data_dir / "engine.log"
    command = engine_command(engine_port, args)
    engine = _start_engine(command, settings.engine_token(), settings.adapter_store, log_path)

    def stop_on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # leaves the wait below; uvicorn has its own handlers once it runs

    previous = signal.signal(signal.SIGTERM, stop_on_signal)
    try:
        _say(f"starting: data in {settings.data_dir}, engine log in {log_path}")
        upgrade(settings.database_url)
        _wait_for_engine(engine, engine_url, log_path, args.engine_timeout)
        demo = ensure_demo(settings, BASE_MODEL, engine_url, DEMO_ADAPTER_DIR)
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        server = _announcing_server(
            # No proxy headers: the client address is decided by LORAPLEX_TRUSTED_PROXIES alone.
            uvicorn.Config(
                create_app(settings), host=args.host, port=args.port, log_level="warning", proxy_headers=False
            ),
            lambda: print(_banner(url, demo, settings), flush=True),
        )
        signal.signal(signal.SIGTERM, previous)
        server.run()  # until Ctrl-C or SIGTERM
        return 0 if server.started else 1
    except KeyboardInterrupt:  # Ctrl-C (uvicorn raises it again after its own clean shutdown)
        return 0
    except _EngineFailed as error:
        print(f"loraplex up: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        _say("stopping the engine")
        _stop(engine)


class _EngineFailed(RuntimeError):
    pass


def _announcing_server(config: uvicorn.Config, on_started: Callable[[], None]) -> uvicorn.Server:
    """uvicorn's Server, calling `on_started` once it listens (that is when the banner is true)."""

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                on_started()

    return Server(config)


def _say(message: str) -> None:
    print(f"loraplex up: {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGTERM when the parent dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start_engine(
    command: list[str], token: str, adapter_store: str, log_path: Path
) -> subprocess.Popen[bytes]:
    # The engine reads adapters only from the control plane's store, as on a cluster.
    env = {**os.environ, "LORAPLEX_INTERNAL_TOKEN": token, "LORAPLEX_ADAPTER_STORE": adapter_store}
    log = log_path.open("ab")
    try:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches us; we stop the engine in order
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    finally:
        log.close()


def _wait_for_engine(engine: subprocess.Popen[bytes], url: str, log_path: Path, timeout: float) -> None:
    import httpx

    began = time.monotonic()
    last_said = 0.0
    while True:
        if engine.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise _EngineFailed(
                f"the engine exited with status {engine.returncode}; its log ends:\n" + "\n".join(tail)
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                _say(f"engine ready after {time.monotonic() - began:.0f} s")
                return
        waited = time.monotonic() - began
        if waited > timeout:
            raise _EngineFailed(f"the engine was not ready after {timeout:.0f} s (see {log_path})")
        if waited - last_said >= 3:
            _say(f"loading {BASE_MODEL} ... {waited:.0f} s")
            last_said = waited
        time.sleep(0.25)


def _stop(engine: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM (the engine drains its requests), then SIGKILL if it takes longer than `grace`."""
    if engine.poll() is not None:
        return
    engine.terminate()
    try:
        engine.wait(grace)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait()


def _banner(url: str, demo: Demo, settings: Settings) -> str:
    assert settings.admin_token is not None  # run() sets one
    admin_token = settings.admin_token.get_secret_value()
    message = {"role": "user", "content": "Say hello to the team."}
    body = json.dumps({"model": demo.adapter, "messages": [message], "max_tokens": 32})
    curl = (
        f"curl -s {url}/v1/chat/completions -H {shlex.quote('Authorization: Bearer ' + demo.api_key)} "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )
    python = "\n".join(
        [
            "from openai import OpenAI",
            f'client = OpenAI(base_url="{url}/v1", api_key="{demo.api_key}")',
            "reply = client.chat.completions.create(",
            f'    model="{demo.adapter}",',
            '    messages=[{"role": "user", "content": "Say hello to the team."}],',
            "    max_tokens=32,",
            ")",
            "print(reply.choices[0].message.content)",
        ]
    )
    return "\n".join(
        [
            "",
            f"{READY_LINE}: {url}",
            "",
            f"  console   {url}/console/   sign in as {demo.email} / {demo.password}",
            f"  API key   {demo.api_key}",
            f"  models    {demo.adapter} (the demo adapter: answers in capitals), {demo.base_model}",
            f"  admin API {url}/admin/v1/   Authorization: Bearer {admin_token}",
            "",
            "Try it with curl:",
            "--- curl ---",
            curl,
            "--- end ---",
            "",
            "or with the OpenAI SDK (pip install openai):",
            "--- python ---",
            python,
            "--- end ---",
            "",
            "Ctrl-C stops everything; the next `loraplex up` keeps the data.",
            "",
        ]
    )
