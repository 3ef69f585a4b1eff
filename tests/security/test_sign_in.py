"""Sign-in throttling under attack, on Postgres and SQLite: parallel guesses cannot pass the limit (the
attempt is counted before the password is checked), and behind a trusted proxy each client is counted
by its own address, not the proxy's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from sqlalchemy import select

from loraplex.web.db.models import SignInFailures
from loraplex.web.services.client_address import client_address, parse_networks, throttle_key
from loraplex.web.services.sign_in_throttle import ADDRESS_FACTOR
from tests.web.conftest import (  # noqa: F401  (fixtures)
    app_factory,
    db_url,
    free_port,
    pg_admin_url,
    pg_template,
    pg_url,
    sqlite_template,
    sqlite_url,
)
from tests.web.console_client import PASSWORD, csrf_of, make_user

pytestmark = pytest.mark.timeout(120)
LIMIT = 5


class Browser:
    """One browser against a served console: its own cookies and CSRF token."""

    def __init__(self, url: str, forwarded_for: str | None = None):
        headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}
        self.client = httpx.Client(base_url=url, headers=headers, timeout=60)
        self.token = csrf_of(self.client.get("/console/sign-in"))

    def sign_in(self, email: str, password: str) -> httpx.Response:
        data = {"email": email, "password": password, "csrf_token": self.token}
        return self.client.post("/console/sign-in", data=data, follow_redirects=False)


@pytest.fixture
def console(
    db_url: str,  # noqa: F811
    app_factory: Callable[..., FastAPI],  # noqa: F811
) -> Iterator[Callable[..., tuple[FastAPI, str]]]:
    """Serves the console on a real port (parallel browsers need real connections)."""
    with ExitStack() as stack:

        def make(**settings: object) -> tuple[FastAPI, str]:
            app = app_factory(db_url, **{"sign_in_max_failures": LIMIT, **settings})
            return app, stack.enter_context(serve_raw(app))

        yield make


@contextmanager
def serve_raw(app: FastAPI) -> Iterator[str]:
    """Like tests.web.servers.serve, but uvicorn leaves X-Forwarded-For alone (its default believes it
    from 127.0.0.1), so what the app decides about the header is what is tested."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", proxy_headers=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _failures(app: FastAPI) -> dict[str, int]:
    with app.state.db.session() as session:
        return {row.subject: row.failures for row in session.scalars(select(SignInFailures))}


def test_parallel_guesses_cannot_pass_the_limit(console: Callable[..., tuple[FastAPI, str]]) -> None:
    app, url = console()
    make_user(app, "ada@acme.test", tenant="acme")
    browsers = [Browser(url) for _ in range(20)]
    start = threading.Barrier(len(browsers))

    def guess(browser: Browser) -> int:
        start.wait()
        return browser.sign_in("ada@acme.test", "wrong guess number").status_code

    with ThreadPoolExecutor(max_workers=len(browsers)) as pool:
        codes = sorted(pool.map(guess, browsers))
    # Exactly LIMIT passwords were checked; every other guess was refused before its check.
    assert codes == [401] * LIMIT + [429] * (len(browsers) - LIMIT)
    assert _failures(app)["email:ada@acme.test"] == LIMIT
    # Now even the right password waits for the window to end.
    assert Browser(url).sign_in("ada@acme.test", PASSWORD).status_code == 429


def test_a_success_gives_its_attempt_back(console: Callable[..., tuple[FastAPI, str]]) -> None:
    app, url = console()
    make_user(app, "ada@acme.test", tenant="acme")
    browser = Browser(url)
    for _ in range(LIMIT - 1):
        assert browser.sign_in("ada@acme.test", "wrong guess number").status_code == 401
    assert browser.sign_in("ada@acme.test", PASSWORD).status_code == 303
    counts = _failures(app)
    assert "email:ada@acme.test" not in counts  # cleared by the success
    assert counts["address:127.0.0.1"] == LIMIT - 1  # the successful attempt was given back


ADDRESS_TEST_LIMIT = 2


def _lock_out_address(url: str, forwarded_for: str | None) -> None:
    """Fail from one client until its address is at its limit (spread over emails, each under its own)."""
    browser = Browser(url, forwarded_for)
    for i in range(ADDRESS_TEST_LIMIT * ADDRESS_FACTOR):
        assert browser.sign_in(f"nobody{i // 2}@acme.test", "wrong guess number").status_code == 401
    assert browser.sign_in("ada@acme.test", PASSWORD).status_code == 429


def test_behind_a_trusted_proxy_each_client_is_counted_by_its_own_address(
    console: Callable[..., tuple[FastAPI, str]],
) -> None:
    app, url = console(trusted_proxies="127.0.0.0/8, 10.0.0.0/8", sign_in_max_failures=ADDRESS_TEST_LIMIT)
    make_user(app, "ada@acme.test", tenant="acme")
    # The attacker's hops to the left of its own address are its own words and count for nothing.
    _lock_out_address(url, "6.6.6.6, 203.0.113.9, 10.1.2.3")
    assert _failures(app)["address:203.0.113.9"] == ADDRESS_TEST_LIMIT * ADDRESS_FACTOR
    # Another user behind the same ingress signs in.
    assert Browser(url, "198.51.100.7, 10.1.2.3").sign_in("ada@acme.test", PASSWORD).status_code == 303
    # Rotating the forged part does not help the attacker either.
    assert Browser(url, "7.7.7.7, 203.0.113.9").sign_in("ada@acme.test", PASSWORD).status_code == 429


def test_without_trusted_proxies_a_forwarded_header_is_ignored(
    console: Callable[..., tuple[FastAPI, str]],
) -> None:
    app, url = console(sign_in_max_failures=ADDRESS_TEST_LIMIT)
    make_user(app, "ada@acme.test", tenant="acme")
    _lock_out_address(url, "203.0.113.9")
    assert set(_failures(app)) >= {"address:127.0.0.1"}
    assert not any("203.0.113.9" in subject for subject in _failures(app))
    assert Browser(url, "198.51.100.7").sign_in("ada@acme.test", PASSWORD).status_code == 429


TRUSTED = parse_networks(["10.0.0.0/8", "2001:db8:1::/48"])


@pytest.mark.parametrize(
    ("peer", "forwarded", "expected"),
    [
        ("10.0.0.1", "1.1.1.1, 2.2.2.2, 10.0.0.7", "2.2.2.2"),  # right-most untrusted hop
        ("9.9.9.9", "2.2.2.2", "9.9.9.9"),  # an untrusted peer's header is not believed
        ("10.0.0.1", None, "10.0.0.1"),
        ("10.0.0.1", "10.0.0.3, 10.0.0.2", "10.0.0.3"),  # all trusted: the farthest one seen
        ("10.0.0.1", "2.2.2.2, not-an-ip", "10.0.0.1"),  # garbage from a proxy: what passed it on
        ("10.0.0.1", "[2001:db8::1]:443", "2001:db8::1"),
        ("10.0.0.1", "2.2.2.2:8080", "2.2.2.2"),
        ("::ffff:10.0.0.1", "2.2.2.2", "2.2.2.2"),  # v4-mapped peers are their v4 selves
        ("2001:db8:1::5", "2.2.2.2", "2.2.2.2"),
        ("testclient", "2.2.2.2", "testclient"),  # not an address at all: kept as it is
    ],
)
def test_client_address(peer: str, forwarded: str | None, expected: str) -> None:
    assert client_address(peer, forwarded, TRUSTED) == expected


def test_client_address_reads_a_bounded_part_of_a_huge_header() -> None:
    forged = ", ".join(["1.1.1.1"] * 200_000)
    assert client_address("10.0.0.1", forged + ", 3.3.3.3", TRUSTED) == "3.3.3.3"
    only_trusted = ", ".join(["10.0.0.9"] * 100) + ", 10.0.0.8"
    assert client_address("10.0.0.1", only_trusted, TRUSTED) == "10.0.0.9"


def test_ipv6_clients_are_counted_per_64() -> None:
    assert throttle_key("2001:db8:abcd:12::1") == throttle_key("2001:db8:abcd:12:ffff::9")
    assert throttle_key("2001:db8:abcd:12::1") != throttle_key("2001:db8:abcd:13::1")
    assert throttle_key("192.0.2.1") == "192.0.2.1"


def test_trusted_proxies_must_be_networks(app_factory: Callable[..., FastAPI]) -> None:  # noqa: F811
    with pytest.raises(ValueError, match=r"LORAPLEX_TRUSTED_PROXIES: 'ten\.0\.0\.0/8' is not"):
        app_factory("sqlite:///:memory:", trusted_proxies="10.0.0.0/8, ten.0.0.0/8")
