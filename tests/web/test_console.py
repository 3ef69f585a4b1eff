"""The console without a browser: sign-in, sessions, throttling, CSRF, roles, pages and the CLI."""

from __future__ import annotations

import datetime as dt
import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from loraplex.cli.main import main as loraplex_main
from loraplex.web.console import charts
from loraplex.web.console.auth import safe_next
from loraplex.web.db.models import Adapter, ApiKey, ConsoleSession, SignInFailures, UsageRecord, UserRole
from loraplex.web.services import users

from .conftest import ADMIN, SHAPE, Api, loose
from .console_client import PASSWORD, csrf_of, make_user, post_form, sign_in
from .servers import StubEngine, serve

pytestmark = pytest.mark.timeout(60)
ADMIN_PAGES = ("/console/admin/tenants", "/console/admin/users", "/console/admin/deployments")
TENANT_PAGES = ("/console", "/console/keys", "/console/adapters", "/console/playground", "/console/usage")


@pytest.fixture
def app(db_url: str, app_factory: Callable[..., FastAPI]) -> FastAPI:
    """The control plane on Postgres and on SQLite."""
    return app_factory(db_url, sign_in_max_failures=3)


@pytest.fixture
def browser(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as client:
        yield client


@pytest.fixture
def member(app: FastAPI, browser: TestClient) -> TestClient:
    """The browser, signed in as a member of tenant acme."""
    make_user(app, "ada@acme.test", tenant="acme")
    assert sign_in(browser, "ada@acme.test").status_code == 303
    return browser


def test_sign_in_sets_a_hardened_session_cookie_and_sign_out_ends_the_session(
    app: FastAPI, browser: TestClient
) -> None:
    make_user(app, "ada@acme.test", tenant="acme")
    first = browser.get("/console/keys", follow_redirects=False)
    assert first.status_code == 303 and first.headers["location"] == "/console/sign-in?next=/console/keys"

    wrong = sign_in(browser, "ada@acme.test", "not the password")
    assert wrong.status_code == 401 and "Wrong email or password." in wrong.text
    unknown = sign_in(browser, "nobody@acme.test")
    assert unknown.status_code == 401 and "Wrong email or password." in unknown.text  # the same answer

    page = browser.get("/console/sign-in?next=/console/keys")
    signed = browser.post(
        "/console/sign-in",
        data={
            "email": "ADA@acme.test ",
            "password": PASSWORD,
            "next": "/console/keys",
            "csrf_token": csrf_of(page),
        },
        follow_redirects=False,
    )
    assert signed.status_code == 303 and signed.headers["location"] == "/console/keys"
    cookie = next(c for c in signed.headers.get_list("set-cookie") if c.startswith("lpx_session="))
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/console" in cookie
    assert "Secure" not in cookie  # plain http here; over https the cookie is Secure
    stolen = browser.cookies.get("lpx_session")
    assert browser.get("/console/keys").status_code == 200

    out = post_form(browser, "/console/keys", "/console/sign-out", {}, follow_redirects=False)
    assert out.status_code == 303
    with app.state.db.session() as session:
        assert session.scalars(select(ConsoleSession)).all() == []
    # A copy of the old cookie signs nobody in: the session is gone on the server.
    replace_cookie(browser, "lpx_session", stolen)
    assert browser.get("/console/keys", follow_redirects=False).status_code == 303


def replace_cookie(client: TestClient, name: str, value: str) -> None:
    """Swap one cookie for `value` (as a thief or a tamperer would), keeping the console's others."""
    domain = next(iter(client.cookies.jar)).domain
    for cookie in [c for c in client.cookies.jar if c.name == name]:
        client.cookies.delete(name, domain=cookie.domain, path=cookie.path)
    client.cookies.set(name, value, domain=domain, path="/console")


def test_tampered_session_cookies_are_refused(app: FastAPI, member: TestClient) -> None:
    value = member.cookies.get("lpx_session")
    assert value and member.get("/console/keys").status_code == 200
    replace_cookie(member, "lpx_session", value[:-2] + ("AA" if not value.endswith("AA") else "BB"))
    assert member.get("/console/keys", follow_redirects=False).status_code == 303


def test_sessions_end_when_the_user_or_the_tenant_is_disabled(app: FastAPI, member: TestClient) -> None:
    assert member.get("/console/keys").status_code == 200
    with app.state.db.session() as session:
        user = users.find_by_email(session, "ada@acme.test")
        assert user is not None and user.tenant_id is not None
        users.set_disabled(session, user.id, True)
    assert member.get("/console/keys", follow_redirects=False).status_code == 303
    refused = sign_in(member, "ada@acme.test")
    assert refused.status_code == 403 and "This account is disabled" in refused.text

    with app.state.db.session() as session:
        users.set_disabled(session, user.id, False)
    assert sign_in(member, "ada@acme.test").status_code == 303
    disabled = member.patch(f"/admin/v1/tenants/{user.tenant_id}", json={"disabled": True}, headers=ADMIN)
    assert disabled.status_code == 200
    assert member.get("/console/keys", follow_redirects=False).status_code == 303


def test_sign_in_is_throttled_per_email_and_recovers_after_the_window(
    app: FastAPI, browser: TestClient
) -> None:
    make_user(app, "ada@acme.test", tenant="acme")
    make_user(app, "bob@acme.test", tenant="acme")
    for _ in range(3):  # the app allows 3 failures per email
        assert sign_in(browser, "ada@acme.test", "guess guess guess").status_code == 401
    locked = sign_in(browser, "ada@acme.test")  # even the right password waits now
    assert locked.status_code == 429
    assert 0 < int(locked.headers["Retry-After"]) <= 900
    assert "Too many failed sign-ins" in locked.text
    assert sign_in(browser, "bob@acme.test").status_code == 303  # another email is not affected

    with app.state.db.session() as session:  # the window has passed
        session.execute(
            update(SignInFailures).values(window_started_at=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
        )
        session.commit()
    browser.cookies.clear()
    assert sign_in(browser, "ada@acme.test").status_code == 303
    with app.state.db.session() as session:
        subjects = {row.subject for row in session.scalars(select(SignInFailures))}
    assert "email:ada@acme.test" not in subjects  # a success clears the email's count


def test_every_state_changing_form_needs_the_csrf_token(app: FastAPI, member: TestClient) -> None:
    page = member.get("/console/keys")
    token = csrf_of(page)
    forms = [
        ("/console/keys", {"name": "forged"}),
        ("/console/sign-out", {}),
        ("/console/adapters", {"name": "x", "deployment": "tiny"}),
        ("/console/playground", {"model": "x", "message": "hi"}),
        ("/console/admin/tenants", {"name": "evil"}),
    ]
    for action, data in forms:
        missing = member.post(action, data=data)
        assert missing.status_code == 403 and "Form refused" in missing.text, action
        wrong = member.post(action, data={**data, "csrf_token": token[:-4] + "0000"})
        assert wrong.status_code == 403, action
    # The right token from another site's page still fails: browsers mark such requests cross-site.
    cross = member.post(
        "/console/keys",
        data={"name": "forged", "csrf_token": token},
        headers={"Sec-Fetch-Site": "cross-site"},
    )
    assert cross.status_code == 403
    # A token minted for another browser (another CSRF cookie) does not fit this one.
    with TestClient(app) as other:
        foreign = csrf_of(other.get("/console/sign-in"))
    assert member.post("/console/keys", data={"name": "forged", "csrf_token": foreign}).status_code == 403
    # The sign-in form too (login CSRF).
    with TestClient(app) as fresh:
        fresh.get("/console/sign-in")
        posted = fresh.post("/console/sign-in", data={"email": "ada@acme.test", "password": PASSWORD})
        assert posted.status_code == 403
    with app.state.db.session() as session:
        assert session.scalars(select(ApiKey)).all() == []
    assert member.get("/console/keys").status_code == 200  # still signed in: sign-out was refused too
    ok = member.post("/console/keys", data={"name": "real", "csrf_token": token})
    assert ok.status_code == 201


def test_members_cannot_open_admin_pages_and_admins_without_a_tenant_have_no_tenant_pages(
    app: FastAPI, member: TestClient
) -> None:
    for path in ADMIN_PAGES:
        refused = member.get(path)
        assert refused.status_code == 403 and "Only platform admins" in refused.text, path
    posted = post_form(member, "/console/keys", "/console/admin/tenants", {"name": "sneaky"})
    assert posted.status_code == 403
    assert 'href="/console/admin/tenants"' not in member.get("/console").text

    make_user(app, "root@platform.test", role=UserRole.ADMIN)
    with TestClient(app) as admin:
        landed = sign_in(admin, "root@platform.test")
        assert landed.headers["location"] == "/console/admin/tenants"
        for path in ADMIN_PAGES:
            assert admin.get(path).status_code == 200, path
        for path in TENANT_PAGES:
            assert admin.get(path).status_code == 403, path
    tenants = TestClient(app).get("/admin/v1/tenants", headers=ADMIN).json()
    assert "sneaky" not in [t["name"] for t in tenants]


def test_admins_create_tenants_users_and_quotas_from_the_console(app: FastAPI) -> None:
    make_user(app, "root@platform.test", role=UserRole.ADMIN)
    with TestClient(app) as admin:
        sign_in(admin, "root@platform.test")
        made = post_form(admin, "/console/admin/tenants", "/console/admin/tenants", {"name": "globex"})
        assert made.status_code == 200 and "Tenant “globex” created." in made.text
        tenant_path = str(made.url.path)
        bad = post_form(admin, "/console/admin/tenants", "/console/admin/tenants", {"name": "no spaces"})
        assert bad.status_code == 422 and 'aria-invalid="true"' in bad.text
        taken = post_form(admin, "/console/admin/tenants", "/console/admin/tenants", {"name": "globex"})
        assert taken.status_code == 409 and "already exists" in taken.text

        quota = post_form(
            admin,
            tenant_path,
            f"{tenant_path}/quota",
            {
                "requests_per_minute": "60",
                "tokens_per_minute": "",
                "max_adapters": "3",
                "max_adapter_bytes": "",
                "max_pinned_adapters": "5",
            },
        )
        assert "Quota saved." in quota.text
        assert re.search(r'name="max_pinned_adapters"[^>]*value="5"', quota.text)  # the form shows it
        tenant = next(
            t for t in admin.get("/admin/v1/tenants", headers=ADMIN).json() if t["name"] == "globex"
        )
        assert tenant["quota"] == {
            "requests_per_minute": 60,
            "tokens_per_minute": None,
            "max_adapters": 3,
            "max_adapter_bytes": None,
            "max_storage_bytes": None,
            "max_in_flight": None,
            "max_pinned_adapters": 5,
        }

        short = post_form(
            admin,
            "/console/admin/users",
            "/console/admin/users",
            {"email": "eve@globex.test", "password": "short", "role": "member", "tenant_id": tenant["id"]},
        )
        assert short.status_code == 422 and "at least 10 characters" in short.text
        orphan = post_form(
            admin,
            "/console/admin/users",
            "/console/admin/users",
            {"email": "eve@globex.test", "password": "a long password", "role": "member", "tenant_id": ""},
        )
        assert orphan.status_code == 422 and "belongs to a tenant" in orphan.text
        created = post_form(
            admin,
            "/console/admin/users",
            "/console/admin/users",
            {
                "email": "eve@globex.test",
                "password": "a long password",
                "role": "member",
                "tenant_id": tenant["id"],
            },
        )
        assert "User eve@globex.test created" in created.text

    with TestClient(app) as eve:
        assert sign_in(eve, "eve@globex.test", "a long password").headers["location"] == "/console"
        assert "globex" in eve.get("/console").text


def test_open_redirects_are_refused_after_sign_in() -> None:
    assert safe_next("/console/keys?x=1") == "/console/keys?x=1"
    for target in ("https://evil.test/console", "//evil.test/console", "/console\\@evil", "/other", None, ""):
        assert safe_next(target) is None


def test_keys_page_shows_a_new_secret_once_and_revokes_after_confirming(
    app: FastAPI, member: TestClient
) -> None:
    empty = member.get("/console/keys")
    assert "No keys yet." in empty.text
    assert empty.headers["Cache-Control"] == "no-store"
    assert "script-src 'self'" in empty.headers["Content-Security-Policy"]
    created = post_form(member, "/console/keys", "/console/keys", {"name": "ci", "expires_in_days": "30"})
    assert created.status_code == 201
    key = re.search(r'value="(lpx_[^"]+)"', created.text)
    assert key
    listed = member.get("/console/keys")
    assert key.group(1) not in listed.text and key.group(1)[:12] in listed.text

    with app.state.db.session() as session:
        row = session.scalars(select(ApiKey)).one()
    unconfirmed = post_form(member, "/console/keys", f"/console/keys/{row.id}/revoke", {})
    assert unconfirmed.status_code == 200 and "Revoke the key “ci”" in unconfirmed.text  # asks first
    with app.state.db.session() as session:
        assert session.scalars(select(ApiKey)).one().revoked_at is None
    done = post_form(member, "/console/keys", f"/console/keys/{row.id}/revoke", {"confirm": "yes"})
    assert "Key “ci” revoked." in done.text
    assert member.get("/v1/models", headers={"Authorization": f"Bearer {key.group(1)}"}).status_code == 401


def test_adapter_upload_without_javascript_shows_errors_inline_and_deletes_after_confirming(
    app: FastAPI, member: TestClient, peft_dir: Path
) -> None:
    assert "No deployments yet." in member.get("/console/adapters").text
    Api(member).deployment("tiny", "tiny-llama", [], shape=SHAPE)
    token = csrf_of(member.get("/console/adapters"))

    def upload(name: str, files: list[tuple[str, bytes]], **headers: str):  # type: ignore[no-untyped-def]
        return member.post(
            "/console/adapters",
            data={"name": name, "deployment": "tiny", "csrf_token": token},
            files=[("files", (f, content, "application/octet-stream")) for f, content in files],
            headers=headers,
        )

    refused = upload("a1", [("model.bin", b"pickle")])
    assert refused.status_code == 422
    assert 'id="adapter-files-error" data-error-for="files">model.bin is refused' in refused.text
    scripted = upload("a1", [("adapter_config.json", b"{}")], accept="application/json")
    assert scripted.status_code == 422 and "files" in scripted.json()["errors"]
    bad_name = upload("no spaces", loose(peft_dir))
    assert bad_name.status_code == 422 and "letters, digits" in bad_name.text

    made = upload("a1", loose(peft_dir))
    assert made.status_code == 200 and "Adapter “a1” is ready" in made.text
    assert re.search(r'badge-ready">ready<', made.text)
    again = upload("a1", loose(peft_dir), accept="application/json")  # the same bytes: no new version
    assert again.status_code == 201 and again.json()["status"] == "ready"
    assert member.get("/console/adapters/status").json() == {"a1": "ready"}
    with member.app.state.db.session() as session:  # type: ignore[attr-defined]
        rows = session.execute(select(Adapter.version, Adapter.uploaded_by)).all()
    # One version, who uploaded it named; the two refused uploads were versions 1 and 2, replaced by it.
    assert [tuple(r) for r in rows] == [(3, "user ada@acme.test")]

    asked = post_form(member, "/console/adapters", "/console/adapters/a1/delete", {})
    assert "Delete the adapter “a1”?" in asked.text
    deleted = post_form(member, "/console/adapters", "/console/adapters/a1/delete", {"confirm": "yes"})
    assert "Adapter “a1” deleted." in deleted.text and "No adapters yet." in deleted.text


def test_playground_streams_through_the_gateway_and_records_usage_without_a_key(
    app: FastAPI, member: TestClient
) -> None:
    stub = StubEngine("e1", tokens=3)
    with serve(stub.app()) as engine:
        Api(member).deployment("smol", "smollm2-135m", [engine])
        token = csrf_of(member.get("/console/playground"))
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        refused = member.post("/console/playground/stream", json=body)
        assert refused.status_code == 403
        streamed = member.post("/console/playground/stream", json=body, headers={"X-CSRF-Token": token})
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        chunks = [json.loads(line[5:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "t0 t1 t2 "
        # The engine got the gateway's headers (tenant, internal token), never a key.
        sent = stub.received[-1]
        assert sent["headers"]["x-loraplex-internal-token"] == "internal-test-token"
        assert "authorization" not in sent["headers"]

        # Without JavaScript: one turn per form post, the conversation carried along.
        answered = member.post(
            "/console/playground",
            data={"model": "smollm2-135m", "message": "hello", "history": "[]", "csrf_token": token},
        )
        assert answered.status_code == 200
        assert '<div class="message-text">hi</div>' in answered.text
        missing = member.post(
            "/console/playground",
            data={"model": "nope", "message": "hello", "history": "[]", "csrf_token": token},
        )
        assert missing.status_code == 400 and "does not exist" in missing.text

    with app.state.db.session() as session:
        records = session.scalars(select(UsageRecord).where(UsageRecord.status == "ok")).all()
    assert len(records) == 2
    assert all(r.api_key_id is None and r.model == "smollm2-135m" for r in records)
    assert records[0].completion_tokens == 3


def test_usage_page_and_csv_export(app: FastAPI, member: TestClient) -> None:
    assert "No requests in the last 30 days." in member.get("/console/usage").text
    with app.state.db.session() as session:
        tenant_id = users.find_by_email(session, "ada@acme.test").tenant_id  # type: ignore[union-attr]
        today = dt.datetime.now(dt.UTC).date()
        for day, model, tokens in (
            (today, "poet", 10),
            (today, "=cmd()", 5),
            (today - dt.timedelta(days=3), "poet", 7),
        ):
            session.add(
                UsageRecord(
                    tenant_id=tenant_id,
                    model=model,
                    endpoint="chat/completions",
                    prompt_tokens=tokens,
                    cached_tokens=tokens // 2,
                    completion_tokens=2 * tokens,
                    status="ok",
                    created_at=dt.datetime.combine(day, dt.time(9), dt.UTC),
                    day=day,
                )
            )
        session.commit()
    page = member.get("/console/usage?days=7")
    assert page.status_code == 200
    assert page.text.count('<rect class="series-') == 3  # two days, the busier model first
    assert "poet: 30 tokens" in page.text and "poet: 21 tokens" in page.text  # the tooltips
    assert member.get("/console/usage?days=0").status_code == 422

    export = member.get("/console/usage.csv?days=7")
    assert export.headers["content-type"].startswith("text/csv")
    assert 'filename="loraplex-usage-acme-' in export.headers["content-disposition"]
    lines = export.text.splitlines()
    assert lines[0] == "day,model,requests,prompt_tokens,cached_tokens,completion_tokens,total_tokens"
    assert f"{today.isoformat()},poet,1,10,5,20,30" in lines
    assert f"{today.isoformat()},'=cmd(),1,5,2,10,15" in lines  # no formula for spreadsheets
    assert len(lines) == 4


def test_chart_scales_stacks_and_escapes() -> None:
    assert [charts.nice_ceiling(v) for v in (0, 1, 3, 10, 11, 4999, 5001)] == [1, 1, 5, 10, 20, 5000, 10000]
    days = charts.day_range(dt.date(2026, 1, 1), dt.date(2026, 1, 3))
    svg = str(
        charts.stacked_bars(
            "c",
            "Tokens <per> day",
            days,
            [charts.Series("<b>x</b>", [10, 0, 5]), charts.Series("y", [10, 0, 0])],
            "tokens",
        )
    )
    assert "<b>" not in svg and "&lt;b&gt;x&lt;/b&gt;" in svg
    heights = [
        float(h)
        for h in re.findall(
            r'<rect class="series-\d" x="[\d.]+" y="[\d.]+" width="[\d.]+" height="([\d.]+)"', svg
        )
    ]
    assert len(heights) == 3  # zero segments are not drawn
    assert heights[0] == heights[1] == pytest.approx(2 * heights[2])
    assert 'role="img"' in svg and "25 tokens in total" in svg
    assert "No usage in this period" in str(charts.stacked_bars("e", "t", days, [], "tokens"))


def test_create_admin_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", url)

    def create(password: str, *extra: str) -> int:
        monkeypatch.setattr("sys.stdin", io.StringIO(password + "\n"))
        return loraplex_main(
            ["control-plane", "create-admin", "--email", "Root@Example.com", "--password-stdin", *extra]
        )

    assert create("too short") == 1
    assert "at least 10 characters" in capsys.readouterr().err
    assert create("the first admin's password") == 0
    assert "admin root@example.com created" in capsys.readouterr().out
    assert create("another password!") == 1
    assert "--update" in capsys.readouterr().err
    assert create("another password!", "--update") == 0

    from loraplex.web.db.session import Database

    db = Database(url)
    try:
        with db.session() as session:
            assert users.verify(session, "root@example.com", "another password!") is not None
            admin = users.find_by_email(session, "root@example.com")
            assert admin is not None and admin.is_admin and admin.tenant_id is None
    finally:
        db.dispose()
