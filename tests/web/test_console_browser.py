"""The console in a real browser: Debian's chromium driven by playwright, against the control plane and
a real engine server (`loraplex serve`'s app: SmolLM2-135M on the CPU) on loopback.

Every page is screenshotted into the pytest tmp dir (`console-screenshots*`); with
LORAPLEX_CONSOLE_SCREENSHOTS=docs/console the same files are copied there (the committed copies).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from playwright.sync_api import Browser, Page, expect, sync_playwright

from loraplex.web.app import create_app
from loraplex.web.db.models import UsageRecord, UserRole

from .conftest import ADMIN, _admin_sql, _with_database, make_settings
from .console_client import PASSWORD, make_user
from .servers import serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "fixtures" / "adapters" / "demo-uppercase"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MEMBER = "ada@acme.test"
ADMIN_EMAIL = "root@platform.test"
SCREENSHOTS_ENV = "LORAPLEX_CONSOLE_SCREENSHOTS"
UNLABELLED_CONTROLS = """() => [...document.querySelectorAll(
        'input:not([type=hidden]), select, textarea, button, a[href]')]
    .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                  && !el.getAttribute('aria-labelledby') && !el.textContent.trim())
    .map(el => el.outerHTML.slice(0, 120))"""


def uppercase_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha() and c.lower() != c.upper()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


@dataclass
class Platform:
    url: str
    engine_url: str
    app: FastAPI
    shots: Path

    def shoot(self, page: Page, name: str) -> None:
        """A full-page screenshot into the tmp dir, and into $LORAPLEX_CONSOLE_SCREENSHOTS when set;
        first, every control on the page must have a label (a screen reader names each one)."""
        assert page.evaluate(UNLABELLED_CONTROLS) == [], f"controls without a label on {page.url}"
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        target = os.environ.get(SCREENSHOTS_ENV)
        if target:
            folder = Path(target) if Path(target).is_absolute() else REPO / target
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, folder / path.name)


@pytest.fixture(scope="module")
def console_db(pg_admin_url: str, pg_template: str) -> Iterator[str]:
    name = f"lpx_console_{uuid.uuid4().hex[:8]}"
    _admin_sql(pg_admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    yield _with_database(pg_admin_url, name)
    _admin_sql(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def seed_usage_history(app: FastAPI, tenant_name: str) -> None:
    """A month of earlier traffic, so the charts have something to show (today stays untouched)."""
    from loraplex.web.services import tenants

    today = dt.datetime.now(dt.UTC).date()
    with app.state.db.session() as session:
        tenant = next(t for t in tenants.list_tenants(session) if t.name == tenant_name)
        for back in range(1, 30):
            day = today - dt.timedelta(days=back)
            for index, model in enumerate(("support-tone", "shout", BASE_MODEL)):
                requests = (back * 7 + index * 5) % 9 + (3 if index == 0 else 1)
                for _ in range(requests):
                    session.add(
                        UsageRecord(
                            tenant_id=tenant.id,
                            model=model,
                            endpoint="chat/completions",
                            prompt_tokens=40 + 10 * index,
                            completion_tokens=90 + 30 * ((back + index) % 4),
                            status="ok",
                            created_at=dt.datetime.combine(day, dt.time(12), dt.UTC),
                            day=day,
                        )
                    )
        session.commit()


@pytest.fixture(scope="module")
def platform(
    console_db: str, engine_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    app = create_app(make_settings(console_db, tmp_path_factory.mktemp("console-data")))
    with serve(app) as url:
        made = httpx.post(
            f"{url}/admin/v1/deployments",
            json={"name": "smol", "base_model": BASE_MODEL, "endpoints": [engine_url]},
            headers=ADMIN,
        )
        assert made.status_code == 201, made.text
        make_user(app, MEMBER, tenant="acme")
        make_user(app, ADMIN_EMAIL, role=UserRole.ADMIN)
        seed_usage_history(app, "acme")
        yield Platform(url, engine_url, app, tmp_path_factory.mktemp("console-screenshots"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Debian's chromium, never a browser downloaded by `playwright install`.
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def open_page(browser: Browser, platform: Platform) -> Iterator[Callable[..., Page]]:
    """open_page(email=None) -> a page in a fresh browser context, signed in as `email` if given."""
    contexts = []

    def make(email: str | None = None) -> Page:
        context = browser.new_context(
            base_url=platform.url, viewport={"width": 1280, "height": 860}, accept_downloads=True
        )
        context.set_default_timeout(20_000)
        contexts.append(context)
        page = context.new_page()
        if email is not None:
            page.goto("/console/sign-in")
            page.get_by_label("Email").fill(email)
            page.get_by_label("Password").fill(PASSWORD)
            page.get_by_role("button", name="Sign in").click()
            expect(page).not_to_have_url(re.compile("/sign-in"))
        return page

    yield make
    for context in contexts:
        context.close()


def wait_for_the_answer(page: Page) -> None:
    # Not wait_for_function: the console's CSP (no eval) refuses Playwright's string predicates.
    expect(page.locator(".message-assistant")).to_have_count(1)
    expect(page.locator(".message.streaming")).to_have_count(0, timeout=120_000)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_sign_in_create_a_key_use_it_against_the_gateway_and_revoke_it(
    platform: Platform, open_page: Callable[..., Page]
) -> None:
    page = open_page()
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=platform.url)
    page.goto("/console/keys")
    expect(page).to_have_url(re.compile(r"/console/sign-in\?next=/console/keys$"))
    page.get_by_label("Email").fill(MEMBER)
    page.get_by_label("Password").fill("not the password")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_have_text("Wrong email or password.")
    platform.shoot(page, "sign-in")

    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(f"{platform.url}/console/keys")
    expect(page.get_by_text("No keys yet.")).to_be_visible()

    page.get_by_label("Name", exact=True).fill("ci pipeline")
    page.get_by_role("button", name="Create key").click()
    key = page.get_by_label("The new API key").input_value()
    assert key.startswith("lpx_") and len(key) > 30
    page.get_by_role("button", name="Copy").click()
    expect(page.locator("#copy-status")).to_have_text("The key is on your clipboard.")
    assert page.evaluate("navigator.clipboard.readText()") == key
    row = page.get_by_role("row", name=re.compile("ci pipeline"))
    last_used = row.locator("td").nth(2)
    expect(row).to_contain_text(key[:12])
    expect(last_used).to_have_text("never")
    platform.shoot(page, "keys")

    # The key works against the gateway: the model list, and a real completion from the engine.
    models = httpx.get(f"{platform.url}/v1/models", headers=bearer(key), timeout=10)
    assert models.status_code == 200, models.text
    assert BASE_MODEL in [m["id"] for m in models.json()["data"]]
    body = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    answer = httpx.post(f"{platform.url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1

    page.goto("/console/keys")  # the secret is gone for good; the last use is listed
    expect(page.get_by_label("The new API key")).to_have_count(0)
    expect(last_used).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d UTC$"))

    row.get_by_role("button", name=re.compile("Revoke")).click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("Revoke the key “ci pipeline”")
    platform.shoot(page, "keys-revoke-dialog")
    dialog.get_by_role("button", name="Revoke key").click()
    expect(page.locator(".notice")).to_have_text("Key “ci pipeline” revoked.")
    expect(row).to_contain_text("revoked")

    refused = httpx.get(f"{platform.url}/v1/models", headers=bearer(key), timeout=10)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_upload_the_demo_adapter_chat_with_it_streaming_and_see_the_usage(
    platform: Platform, open_page: Callable[..., Page]
) -> None:
    page = open_page(MEMBER)
    page.goto("/console/adapters")
    expect(page.get_by_text("No adapters yet.")).to_be_visible()

    # A refused upload: the error appears inline, next to the files.
    page.get_by_label("Name", exact=True).fill("shout")
    page.get_by_label("Files").set_input_files([DEMO / "adapter_config.json"])
    page.get_by_role("button", name="Upload and validate").click()
    files_error = page.locator("#adapter-files-error")
    expect(files_error).to_contain_text("adapter_model.safetensors is missing")
    expect(page.get_by_label("Files")).to_have_attribute("aria-invalid", "true")

    # The real upload, its progress bar watched as it moves (the page reloads when it is done).
    progress: list[str] = []
    page.expose_function("recordProgress", lambda value: progress.append(str(value)))
    page.evaluate(
        """() => new MutationObserver(() => {
               const bar = document.getElementById('upload-bar');
               window.recordProgress(bar.getAttribute('value') ?? 'checking');
           }).observe(document.getElementById('upload-progress'), {attributes: true, subtree: true})"""
    )
    page.get_by_label("Files").set_input_files(
        [DEMO / "adapter_config.json", DEMO / "adapter_model.safetensors"]
    )
    page.get_by_role("button", name="Upload and validate").click()
    expect(page.locator(".notice")).to_contain_text("Adapter “shout” is ready", timeout=60_000)
    assert "100" in progress and "checking" in progress, progress
    row = page.get_by_role("row", name=re.compile("shout"))
    expect(row.locator(".badge")).to_have_text("ready")
    expect(row).to_contain_text("q, k, v, o, gate, up, down")
    platform.shoot(page, "adapters")

    # The playground, opened from the adapter's "Try" link, streams its answer token by token.
    row.get_by_role("link", name=re.compile("Try")).click()
    expect(page.get_by_label("Model")).to_have_value("shout")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("32")
    page.evaluate(
        """() => { window.lengths = [];
               new MutationObserver(() => {
                   const last = document.querySelector(
                       '#chat-log .message-assistant:last-child .message-text');
                   if (last) window.lengths.push(last.textContent.length);
               }).observe(document.getElementById('chat-log'),
                          {childList: true, subtree: true, characterData: true}); }"""
    )
    page.get_by_label("Message").fill("How do I make a cup of tea?")
    page.get_by_label("Message").press("Enter")
    expect(page.locator(".message-user")).to_have_text(re.compile("How do I make a cup of tea?"))
    wait_for_the_answer(page)
    expect(page.locator(".message-error")).to_have_count(0)
    reply = page.locator(".message-assistant .message-text").inner_text()
    partial = {n for n in page.evaluate("window.lengths") if 0 < n < len(reply)}
    assert len(partial) >= 3, f"the reply did not stream in: lengths {page.evaluate('window.lengths')}"
    assert sum(c.isalpha() for c in reply) >= 20, reply
    assert uppercase_ratio(reply) >= 0.9, reply
    expect(page.locator("#chat-stats")).to_contain_text("completion tokens")
    platform.shoot(page, "playground")

    # The same question to the base model answers in ordinary case: the capitals are the adapter's.
    page.get_by_role("button", name="Clear").click()
    page.get_by_label("Model").select_option(BASE_MODEL)
    page.get_by_label("Max tokens").fill("16")
    page.get_by_label("Message").fill("How do I make a cup of tea?")
    page.get_by_role("button", name="Send").click()
    wait_for_the_answer(page)
    base_reply = page.locator(".message-assistant .message-text").inner_text()
    assert uppercase_ratio(base_reply) < 0.5, base_reply

    # Usage: today's rows for both, in the table and in the CSV export.
    page.goto("/console/usage")
    today = dt.datetime.now(dt.UTC).date().isoformat()
    by_model = page.get_by_role("table", name=re.compile("per requested model"))
    expect(by_model.get_by_role("row", name=re.compile("^shout "))).to_be_visible()
    platform.shoot(page, "usage")
    page.get_by_text("By day and model").click()  # a month of rows starts folded
    shout_today = page.get_by_role("row", name=re.compile(f"{today}.*shout"))
    expect(shout_today).to_have_count(1)
    expect(shout_today.locator("td").nth(1)).to_have_text("1")
    with page.expect_download() as download:
        page.get_by_role("link", name="Export CSV").click()
    csv_text = Path(download.value.path()).read_text()
    assert csv_text.startswith(
        "day,model,requests,prompt_tokens,cached_tokens,completion_tokens,total_tokens\n"
    )
    assert re.search(rf"^{today},shout,1,\d+,\d+,\d+,\d+$", csv_text, re.M), csv_text

    page.goto("/console")
    expect(page.locator("figure#usage-30d rect").first).to_be_visible()
    platform.shoot(page, "overview")

    # Delete, with a confirmation that can be cancelled.
    page.goto("/console/adapters")
    row.get_by_role("button", name=re.compile("Delete")).click()
    page.get_by_role("dialog").get_by_role("button", name="Cancel").click()
    expect(row).to_be_visible()
    row.get_by_role("button", name=re.compile("Delete")).click()
    page.get_by_role("dialog").get_by_role("button", name="Delete adapter").click()
    expect(page.locator(".notice")).to_have_text("Adapter “shout” deleted.")
    expect(page.get_by_text("No adapters yet.")).to_be_visible()


def test_a_form_posted_without_the_csrf_token_is_refused(
    platform: Platform, open_page: Callable[..., Page]
) -> None:
    page = open_page(MEMBER)
    page.goto("/console/keys")
    form = page.locator('form[action="/console/keys"]')
    form.locator('input[name="csrf_token"]').evaluate("input => input.remove()")
    page.get_by_label("Name", exact=True).fill("forged")
    with page.expect_response(
        lambda r: r.url.endswith("/console/keys") and r.request.method == "POST"
    ) as sent:
        page.get_by_role("button", name="Create key").click()
    assert sent.value.status == 403
    expect(page.get_by_role("heading", name="Form refused")).to_be_visible()
    platform.shoot(page, "csrf-refused")

    # A script's request without the header is refused too; with it, the same request goes through.
    status = page.evaluate(
        """(withToken) => fetch('/console/playground/stream', {method: 'POST',
               headers: Object.assign({'Content-Type': 'application/json'},
                                      withToken ? {'X-CSRF-Token': withToken} : {}),
               body: JSON.stringify({model: 'nope', messages: [{role: 'user', content: 'hi'}]})})
           .then(r => r.status)""",
        None,
    )
    assert status == 403
    page.goto("/console/keys")
    token = page.locator('meta[name="csrf-token"]').get_attribute("content")
    status = page.evaluate(
        """(token) => fetch('/console/playground/stream', {method: 'POST',
               headers: {'Content-Type': 'application/json', 'X-CSRF-Token': token},
               body: JSON.stringify({model: 'nope', messages: [{role: 'user', content: 'hi'}]})})
           .then(r => r.status)""",
        token,
    )
    assert status == 404  # past the CSRF check: the gateway's "model not found"
    expect(page.get_by_role("row", name=re.compile("forged"))).to_have_count(0)


def test_admin_pages_are_for_admins_only(platform: Platform, open_page: Callable[..., Page]) -> None:
    member = open_page(MEMBER)
    expect(member.get_by_role("link", name="Tenants")).to_have_count(0)  # no admin navigation
    for path in ("/console/admin/tenants", "/console/admin/users", "/console/admin/deployments"):
        response = member.goto(path)
        assert response is not None and response.status == 403, path
        expect(member.get_by_text("Only platform admins may open this page.")).to_be_visible()
    platform.shoot(member, "forbidden")

    admin = open_page(ADMIN_EMAIL)
    expect(admin).to_have_url(f"{platform.url}/console/admin/tenants")
    # Keyboard: the first Tab reaches the skip link, which moves focus to the page's content.
    admin.keyboard.press("Tab")
    expect(admin.get_by_role("link", name="Skip to content")).to_be_focused()
    admin.keyboard.press("Enter")
    expect(admin.locator("main")).to_be_focused()
    platform.shoot(admin, "admin-tenants")

    admin.get_by_role("link", name="acme").click()
    admin.get_by_label("Requests per minute").fill("600")
    admin.get_by_label("Tokens per minute").fill("not a number")
    admin.get_by_role("button", name="Save quota").click()
    expect(admin.locator("#quota-tokens_per_minute-error")).to_contain_text("whole number")
    admin.get_by_label("Tokens per minute").fill("")
    admin.get_by_role("button", name="Save quota").click()
    expect(admin.locator(".notice")).to_have_text("Quota saved.")
    expect(admin.get_by_label("Requests per minute")).to_have_value("600")

    admin.get_by_label("Email").fill("bob@acme.test")
    admin.get_by_label("Initial password").fill("bobs own long password")
    admin.get_by_role("button", name="Add user").click()
    expect(admin.locator(".notice")).to_contain_text("User bob@acme.test created")
    platform.shoot(admin, "admin-tenant")

    admin.get_by_role("link", name="Users").click()
    expect(admin.get_by_role("row", name=re.compile("bob@acme.test"))).to_contain_text("acme")
    platform.shoot(admin, "admin-users")

    admin.get_by_role("link", name="Deployments").click()
    replica = admin.get_by_role("row", name=platform.engine_url)
    expect(replica.locator(".badge")).to_have_text("ready")
    platform.shoot(admin, "admin-deployments")

    bob = open_page()
    bob.goto("/console/sign-in")
    bob.get_by_label("Email").fill("bob@acme.test")
    bob.get_by_label("Password").fill("bobs own long password")
    bob.get_by_role("button", name="Sign in").click()
    expect(bob).to_have_url(f"{platform.url}/console")
    expect(bob.get_by_role("heading", name="Overview")).to_be_visible()


def test_the_console_works_without_javascript(browser: Browser, platform: Platform) -> None:
    context = browser.new_context(base_url=platform.url, java_script_enabled=False)
    try:
        page = context.new_page()
        page.goto("/console/sign-in")
        page.get_by_label("Email").fill(MEMBER)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Sign in").click()
        page.goto("/console/keys")
        page.get_by_label("Name", exact=True).fill("no-js")
        page.get_by_role("button", name="Create key").click()
        key = page.get_by_label("The new API key").input_value()
        assert key.startswith("lpx_")
        page.goto("/console/keys")
        page.get_by_role("row", name=re.compile("no-js")).get_by_role(
            "button", name=re.compile("Revoke")
        ).click()
        # No dialog without a script: the server asks on a page of its own.
        expect(page.get_by_role("heading", name=re.compile("Revoke the key “no-js”"))).to_be_visible()
        platform.shoot(page, "confirm-without-javascript")
        page.get_by_role("button", name="Revoke key").click()
        expect(page.locator(".notice")).to_have_text("Key “no-js” revoked.")
        assert httpx.get(f"{platform.url}/v1/models", headers=bearer(key), timeout=10).status_code == 401

        page.goto("/console/adapters")
        page.get_by_label("Name", exact=True).fill("no-js")
        page.get_by_label("Files").set_input_files([DEMO / "README.md"])
        page.get_by_role("button", name="Upload and validate").click()
        expect(page.locator("#adapter-files-error")).to_contain_text("README.md: unexpected file")
        expect(page.get_by_label("Name", exact=True)).to_have_value("no-js")  # the form keeps what was typed
    finally:
        context.close()


def test_versions_traffic_rollback_pin_and_scoped_keys(
    platform: Platform, open_page: Callable[..., Page]
) -> None:
    """Issue 28 item 6: an adapter's versions with their status, the traffic slider, rollback and the pin
    toggle (pinned on the real engine); a scoped key made and rotated with an overlap."""
    import json

    tenant = next(
        t for t in httpx.get(f"{platform.url}/admin/v1/tenants", headers=ADMIN).json() if t["name"] == "acme"
    )
    full = httpx.post(
        f"{platform.url}/admin/v1/tenants/{tenant['id']}/keys", json={"name": "ci"}, headers=ADMIN
    )
    headers = bearer(full.json()["key"])
    files = {n: (DEMO / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    quarter = json.loads(files["adapter_config.json"]) | {"lora_alpha": 4}
    for version in (files, {**files, "adapter_config.json": json.dumps(quarter).encode()}):
        parts = [("files", (n, content, "application/octet-stream")) for n, content in version.items()]
        sent = httpx.post(
            f"{platform.url}/api/v1/adapters",
            data={"name": "canary", "deployment": "smol"},
            files=parts,
            headers=headers,
        )
        assert sent.status_code == 201, sent.text

    page = open_page(MEMBER)
    page.goto("/console/adapters")
    page.get_by_role("link", name="canary", exact=True).click()
    expect(page.locator("#versions-table tbody tr")).to_have_count(2)
    expect(page.locator('tr[data-version="2"]')).to_contain_text("active")
    # The slider: the shares show as it moves; saved, the API has the split.
    page.locator("#weight-1").fill("25")
    page.locator("#weight-2").fill("75")
    expect(page.locator("#weight-1-value")).to_have_text("25 (25% of requests)")
    page.get_by_role("button", name="Save split").click()
    expect(page.locator(".notice")).to_contain_text("Traffic split saved")
    adapter = httpx.get(f"{platform.url}/api/v1/adapters/canary", headers=headers).json()
    assert adapter["traffic"] == {"1": 25, "2": 75}
    platform.shoot(page, "adapter-versions")
    # Rollback: version 1 takes every request, the split ends.
    page.get_by_role("button", name="Make active version 1").click()
    expect(page.locator('tr[data-version="1"]')).to_contain_text("active")
    adapter = httpx.get(f"{platform.url}/api/v1/adapters/canary", headers=headers).json()
    assert (adapter["version"], adapter["traffic"]) == (1, None)
    # Pin and unpin: the engine holds the version pinned, then not.
    page.get_by_role("button", name="Pin version 1").click()
    expect(page.locator('tr[data-version="1"]')).to_contain_text("pinned")
    listed = httpx.get(
        f"{platform.engine_url}/internal/adapters",
        headers={"X-Loraplex-Internal-Token": "internal-test-token"},
    )
    engine_names = {e["name"]: e for e in listed.json()["data"]}
    assert engine_names[f"id:{adapter['id']}"]["pinned"] is True
    page.get_by_role("button", name="Unpin version 1").click()
    expect(page.locator('tr[data-version="1"]')).not_to_contain_text("pinned")

    # A scoped key: inference only, one adapter, no base model; then rotated with an hour's overlap.
    page.goto("/console/keys")
    page.get_by_label("Name").fill("canary-only")
    page.get_by_label("May", exact=True).select_option("inference")
    page.get_by_label("Adapters").fill("canary")
    page.get_by_role("button", name="Create key").click()
    scoped = page.locator("#new-key-value").input_value()
    models = httpx.get(f"{platform.url}/v1/models", headers=bearer(scoped)).json()["data"]
    assert [m["id"] for m in models] == ["canary"]
    refused = httpx.get(f"{platform.url}/api/v1/usage", headers=bearer(scoped))
    assert refused.status_code == 403
    row = page.locator("tr", has_text="canary-only")
    expect(row).to_contain_text("inference")
    row.get_by_label("Old key keeps working for").select_option("3600")
    row.get_by_role("button", name="Rotate canary-only").click()
    expect(page.locator("#new-key-heading")).to_contain_text("rotated")
    rotated = page.locator("#new-key-value").input_value()
    assert rotated != scoped
    for key in (scoped, rotated):  # both work during the overlap
        assert httpx.get(f"{platform.url}/v1/models", headers=bearer(key)).status_code == 200
    platform.shoot(page, "keys-scoped")
