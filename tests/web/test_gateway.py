from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from loraplex.adapters import fetch_local
from loraplex.web.db.models import Deployment, UsageRecord
from loraplex.web.services.gateway import estimate_tokens
from loraplex.web.services.routing import rendezvous_order
from loraplex.wire import limits

from ..security.engine_stub import Engine
from .conftest import ADMIN, SHAPE, Api, free_port, loose, recorded_usage, upload
from .console_client import make_user, sign_in
from .servers import HangUp, StubEngine, serve

pytestmark = pytest.mark.timeout(60)


@dataclass
class Setup:
    app: FastAPI
    url: str
    engines: dict[str, StubEngine]  # endpoint -> stub
    admin: TestClient
    tenant_id: str
    key: str
    adapter: dict[str, object]
    stack: ExitStack

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def usage(self, timeout: float = 10.0, count: int = 1) -> list[UsageRecord]:
        return recorded_usage(self.app, count, timeout)


@pytest.fixture
def setup(pg_url: str, app_factory: Callable[..., FastAPI], peft_dir: Path) -> Iterator[Setup]:
    with ExitStack() as stack:
        engines = {}
        for name in ("e1", "e2"):
            stub = StubEngine(name)
            engines[stack.enter_context(serve(stub.app()))] = stub
        stack.callback(lambda: [e.gate.set() for e in engines.values()])  # let stubs finish before stop
        app = app_factory(pg_url)
        url = stack.enter_context(serve(app))
        admin = stack.enter_context(TestClient(app_factory(pg_url)))
        api = Api(admin)
        api.deployment("tiny", "tiny-llama", list(engines), shape=SHAPE)
        tenant, headers = api.tenant_with_key("acme")
        made = upload(admin, headers, loose(peft_dir), name="poet")
        assert made.status_code == 201, made.text
        yield Setup(
            app, url, engines, admin, str(tenant["id"]), headers["Authorization"][7:], made.json(), stack
        )


def chat(model: str = "poet", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Write a poem."}], **extra}


def test_routes_by_adapter_affinity_with_headers_and_falls_back(setup: Setup) -> None:
    sha = str(setup.adapter["sha256"])
    preferred, other = rendezvous_order(f"adapter:{sha}", list(setup.engines))
    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as client:
        for _ in range(4):
            response = client.post("/v1/chat/completions", json=chat())
            assert response.status_code == 200, response.text
            assert response.json()["served_by"] == setup.engines[preferred].name
        assert setup.engines[other].received == []
        seen = setup.engines[preferred].received[0]
        headers = seen["headers"]
        assert headers["x-loraplex-tenant"] == setup.tenant_id
        assert headers["x-loraplex-adapter-sha256"] == sha
        assert headers["x-loraplex-internal-token"] == "internal-test-token"
        assert fetch_local(headers["x-loraplex-adapter-uri"], sha).is_dir()  # the engine can fetch it
        assert setup.key not in json.dumps(seen)  # the tenant's key never reaches the engine
        assert seen["body"]["model"] == "poet"

        # The base model goes through too, without adapter headers.
        response = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi"})
        assert response.status_code == 200
        base_calls = [r for e in setup.engines.values() for r in e.received if r["path"] == "/v1/completions"]
        assert "x-loraplex-adapter-uri" not in base_calls[0]["headers"]

    # The preferred replica goes down (its address now refuses connections): the adapter moves on.
    for _ in range(200):  # a closed address that still ranks first for this adapter
        closed = f"http://127.0.0.1:{free_port()}"
        endpoints = [closed if e == preferred else e for e in setup.engines]
        order = rendezvous_order(f"adapter:{sha}", endpoints)
        if order[0] == closed:
            break
    with setup.app.state.db.session() as session:
        deployment = session.scalar(select(Deployment))
        assert deployment is not None
        deployment.endpoints = endpoints
        session.commit()
    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as client:
        before = len(setup.engines[other].received)
        response = client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 200, response.text
        assert response.json()["served_by"] == setup.engines[other].name
        assert len(setup.engines[other].received) == before + 1
    assert order[0] == closed  # the fallback really was exercised


def test_a_replica_that_hangs_up_before_answering_goes_to_the_next_replica(setup: Setup) -> None:
    """A pod going away may close the connection the gateway just sent on, with no answer at all (seen in
    the walkthrough's scale-in): nothing was produced, so the next replica takes the request."""
    sha = str(setup.adapter["sha256"])
    preferred, other = rendezvous_order(f"adapter:{sha}", list(setup.engines))
    for _ in range(200):  # a hanging-up address that ranks first for this adapter
        hang_up = HangUp()
        setup.stack.callback(hang_up.close)
        endpoints = [hang_up.url if e == preferred else e for e in setup.engines]
        if rendezvous_order(f"adapter:{sha}", endpoints)[0] == hang_up.url:
            break
    with setup.app.state.db.session() as session:
        deployment = session.scalar(select(Deployment))
        assert deployment is not None
        deployment.endpoints = endpoints
        session.commit()
    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as client:
        response = client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 200, response.text
        assert response.json()["served_by"] == setup.engines[other].name
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as stream:
            assert stream.status_code == 200
            assert "data: [DONE]" in stream.read().decode()
    assert hang_up.connections >= 1  # it really was asked first


def test_streams_without_buffering_and_records_exact_usage(setup: Setup) -> None:
    for stub in setup.engines.values():
        stub.gate.clear()
    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as client:
        body = chat(stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            # The engine is still holding the rest: the first chunk came through on its own.
            assert json.loads(first[6:])["choices"][0]["delta"]["content"] == "t0 "
            assert sum(e.chunks_sent for e in setup.engines.values()) == 1
            for stub in setup.engines.values():
                stub.gate.set()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 4
    [row] = setup.usage()
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.exact) == ("ok", 5, 4, True)
    assert row.model == "poet" and row.adapter_id is not None and str(row.tenant_id) == setup.tenant_id


def test_client_disconnect_mid_stream_still_records_usage(setup: Setup) -> None:
    for stub in setup.engines.values():
        stub.gate.clear()
    client = httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10)
    with client, client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
        first = next(line for line in response.iter_lines() if line)
        assert first.startswith("data: ")
    # leaving the block closed the connection mid-stream; the engine is still holding the rest
    [row] = setup.usage()
    assert row.status == "client_disconnected"
    assert row.exact is False and row.completion_tokens == 1 and row.prompt_tokens >= 1


def test_stream_without_final_usage_is_estimated(setup: Setup) -> None:
    for stub in setup.engines.values():
        stub.send_usage = False
    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as client:
        text = client.post("/v1/chat/completions", json=chat(stream=True)).text
    assert text.endswith("data: [DONE]\n\n")
    [row] = setup.usage()
    assert (row.status, row.completion_tokens, row.exact) == ("ok_estimated", 4, False)


def pin_to_one_minute(*apps: FastAPI) -> None:
    """Quotas count by the gateway's clock (app.state.clock): stopped ten seconds into the current
    minute, a burst cannot straddle two minute windows, and no test waits for the next minute to begin."""
    now = float(int(time.time()) // 60 * 60 + 10)
    for app in apps:
        app.state.clock = lambda: now


def _fire(urls: list[str], headers: dict[str, str], body: dict[str, object], n: int) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        with httpx.Client(base_url=urls[i % len(urls)], headers=headers, timeout=20) as client:
            return client.post("/v1/chat/completions", json=body)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def test_requests_per_minute_hold_across_gateway_replicas(
    setup: Setup, pg_url: str, app_factory: Callable[..., FastAPI]
) -> None:
    setup.admin.put(
        f"/admin/v1/tenants/{setup.tenant_id}/quota", json={"requests_per_minute": 5}, headers=ADMIN
    )
    second_app = app_factory(pg_url)
    pin_to_one_minute(setup.app, second_app)  # the whole burst counts in one minute window
    second = setup.stack.enter_context(serve(second_app))
    responses = _fire([setup.url, second], setup.headers, chat(), 16)
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 5 + [429] * 11
    refused = next(r for r in responses if r.status_code == 429)
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "5 requests per minute" in refused.json()["error"]["message"]


def test_tokens_per_minute_hold_under_concurrency(setup: Setup) -> None:
    tpm = 100
    setup.admin.put(
        f"/admin/v1/tenants/{setup.tenant_id}/quota", json={"tokens_per_minute": tpm}, headers=ADMIN
    )
    for stub in setup.engines.values():
        stub.delay_s = 1.0  # every admitted request holds its reservation while the burst arrives
    pin_to_one_minute(setup.app)
    body = chat(max_tokens=40)
    responses = _fire([setup.url], setup.headers, body, 10)
    admitted = sum(r.status_code == 200 for r in responses)
    # Each holds its prompt and its whole max_tokens until it ends; a reservation must fit under the limit.
    assert admitted == tpm // (estimate_tokens("Write a poem.") + 40)
    assert all(r.status_code in (200, 429) for r in responses)
    rows = setup.usage(count=admitted)
    assert len(rows) == admitted and all(r.completion_tokens == 4 for r in rows)


def test_openai_sdk_against_the_gateway(setup: Setup) -> None:
    client = openai.OpenAI(base_url=f"{setup.url}/v1", api_key=setup.key, max_retries=0, timeout=10)
    reply = client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "hi" and reply.usage and reply.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model="poet", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "t0 t1 t2 t3 "
    assert {m.id for m in client.models.list()} == {"poet", "tiny-llama"}

    other = Api(setup.admin)
    _, other_headers = other.tenant_with_key("other")
    intruder = openai.OpenAI(
        base_url=f"{setup.url}/v1", api_key=other_headers["Authorization"][7:], max_retries=0, timeout=10
    )
    errors = []
    for model in ("poet", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as caught:
            intruder.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        errors.append(caught.value.body)
    assert errors[0] == json.loads(json.dumps(errors[1]).replace("no-such-adapter", "poet"))
    assert "poet" not in {m.id for m in intruder.models.list()}

    bad = openai.OpenAI(base_url=f"{setup.url}/v1", api_key="lpx_nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()

    setup.admin.put(
        f"/admin/v1/tenants/{setup.tenant_id}/quota", json={"requests_per_minute": 0}, headers=ADMIN
    )
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}])


def test_models_retrieve_root_parent_and_openai_route_errors(setup: Setup) -> None:
    client = openai.OpenAI(base_url=f"{setup.url}/v1", api_key=setup.key, max_retries=0, timeout=10)
    cards = {m.id: m.model_dump() for m in client.models.list()}
    assert cards["tiny-llama"]["root"] == "tiny-llama" and cards["tiny-llama"]["parent"] is None
    assert cards["poet"]["root"] == cards["poet"]["parent"] == "tiny-llama"  # vLLM's: the adapter's base
    assert client.models.retrieve("poet").model_dump() == cards["poet"]
    assert client.models.retrieve("tiny-llama").model_dump() == cards["tiny-llama"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"

    _, other_headers = Api(setup.admin).tenant_with_key("other")
    intruder = openai.OpenAI(
        base_url=f"{setup.url}/v1", api_key=other_headers["Authorization"][7:], max_retries=0, timeout=10
    )
    with pytest.raises(openai.NotFoundError) as hidden:  # another tenant's adapter reads as missing
        intruder.models.retrieve("poet")
    assert hidden.value.body == json.loads(json.dumps(missing.value.body).replace("no-such-model", "poet"))

    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as http:
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
            response = http.request(method, path)
            assert response.status_code == status
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and path in error["message"]
        assert "detail" in http.get("/api/v1/nothing").json()  # the other APIs keep FastAPI's shape


def test_token_id_prompts_reach_the_engine_within_its_caps(setup: Setup) -> None:
    client = openai.OpenAI(base_url=f"{setup.url}/v1", api_key=setup.key, max_retries=0, timeout=10)
    for prompt in ([5820, 827], [[5820, 827]], ["one text"]):
        reply = client.completions.create(model="poet", prompt=prompt, max_tokens=4)
        assert reply.choices[0].index == 0
        assert [r["body"]["prompt"] for e in setup.engines.values() for r in e.received][-1] == prompt
    too_many = [7] * (limits.MAX_PROMPT_TOKENS + 1)
    for prompt in (too_many, [too_many]):  # the engine's cap, met at the gateway before any quota
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="poet", prompt=prompt, max_tokens=4)
        assert refused.value.param == "prompt" and str(limits.MAX_PROMPT_TOKENS) in refused.value.message
    with pytest.raises(openai.BadRequestError) as mixed:  # neither a text, token ids, nor a list of one
        client.completions.create(model="poet", prompt=[1, "two"], max_tokens=4)  # type: ignore[arg-type]
    assert mixed.value.param is not None and mixed.value.param.startswith("prompt")


def test_usage_summary_by_day_and_model(setup: Setup) -> None:
    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        assert client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x"}).status_code == 200
    setup.usage(count=3)
    summary = setup.admin.get("/api/v1/usage", headers=setup.headers).json()
    by_model = {r["model"]: r for r in summary["rows"]}
    assert by_model["poet"]["requests"] == 2 and by_model["poet"]["completion_tokens"] == 8
    assert by_model["tiny-llama"]["requests"] == 1
    assert summary["requests"] == 3 and summary["prompt_tokens"] == 15


def test_unreachable_deployment_is_503_and_recorded(pg_url: str, app_factory: Callable[..., FastAPI]) -> None:
    with TestClient(app_factory(pg_url, engine_connect_timeout_s=2.0)) as client:
        api = Api(client)
        api.deployment("gone", "tiny-llama", [f"http://127.0.0.1:{free_port()}"], shape=SHAPE)
        _, headers = api.tenant_with_key("acme")
        response = client.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": "x"}, headers=headers
        )
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
        with client.app.state.db.session() as session:  # type: ignore[attr-defined]
            assert [r.status for r in session.scalars(select(UsageRecord))] == ["no_replica"]


# -- caps on what a request body may hold (wire/limits.py, checked before anything is spent) ---


def _caps_client(client: TestClient) -> dict[str, str]:
    api = Api(client)
    api.deployment("tiny", "tiny-llama", [f"http://127.0.0.1:{free_port()}"], shape=SHAPE)
    return api.tenant_with_key("acme")[1]


def _completion(**extra: object) -> dict[str, object]:
    return {"model": "tiny-llama", "prompt": "hi", **extra}


CAPPED = [
    ("stop", _completion(stop=["x"] * (limits.MAX_STOP_SEQUENCES + 1))),
    ("stop", _completion(stop="x" * (limits.MAX_STOP_CHARS + 1))),
    ("stop", _completion(stop=[1])),
    ("logit_bias", _completion(logit_bias={str(i): 1 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)})),
    ("logit_bias", _completion(logit_bias={"5": 100.5})),
    ("logit_bias", _completion(logit_bias={"9" * 5000: 1})),
    ("logit_bias", _completion(logit_bias=[1, 2])),
    ("presence_penalty", _completion(presence_penalty=2.5)),
    ("frequency_penalty", _completion(frequency_penalty=-2.5)),
    ("repetition_penalty", _completion(repetition_penalty=0)),
    ("repetition_penalty", _completion(repetition_penalty=limits.MAX_REPETITION_PENALTY + 0.5)),
    ("n", _completion(n=limits.MAX_CHOICES + 1)),
    ("n", _completion(n=0)),
    ("best_of", _completion(best_of=limits.MAX_BEST_OF + 1)),
    ("best_of", _completion(n=3, best_of=2)),  # best_of is at least n
    ("n", _completion(prompt=["a"] * 5, n=limits.MAX_SEQUENCES // 4)),  # prompts x n over MAX_SEQUENCES
    ("prompt", _completion(prompt=["a"] * (limits.MAX_PROMPTS + 1))),
    ("max_tokens", _completion(max_tokens=0)),
    ("max_tokens", _completion(max_tokens=limits.MAX_COMPLETION_TOKENS + 1)),
    ("max_completion_tokens", _completion(max_completion_tokens=5)),  # not a /v1/completions field
    ("prompt", _completion(prompt="x" * (limits.MAX_PROMPT_CHARS + 1))),
    ("prompt", _completion(prompt=["a"] * (limits.MAX_PROMPT_TOKENS + 1))),
]


@pytest.mark.parametrize(("field", "body"), CAPPED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CAPPED)])
def test_caps_are_400s_naming_the_field(
    sqlite_url: str, app_factory: Callable[..., FastAPI], field: str, body: dict[str, object]
) -> None:
    with TestClient(app_factory(sqlite_url)) as client:
        headers = _caps_client(client)
        response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert field in error["message"]


def test_chat_caps_and_hostile_json(sqlite_url: str, app_factory: Callable[..., FastAPI]) -> None:
    with TestClient(app_factory(sqlite_url)) as client:
        headers = {**_caps_client(client), "Content-Type": "application/json"}
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}

        def post(content: bytes, path: str = "/v1/chat/completions") -> dict[str, object]:
            response = client.post(path, content=content, headers=headers)
            assert 400 <= response.status_code < 500, response.text
            return {"status": response.status_code, **response.json()["error"]}

        many = {**chat, "messages": [{"role": "user", "content": "x"}] * (limits.MAX_CHAT_MESSAGES + 1)}
        assert post(json.dumps(many).encode())["param"] == "messages"
        zero = {**chat, "max_completion_tokens": 0}
        assert post(json.dumps(zero).encode())["param"] == "max_completion_tokens"
        # Python's json would take these; a request must not.
        for number in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
            error = post(
                b'{"model": "tiny-llama", "prompt": "hi", "temperature": ' + number + b"}", "/v1/completions"
            )
            assert error["status"] == 400 and "not" in str(error["message"])
        assert post(b"[" * 100_000 + b"]" * 100_000)["status"] == 400
        assert post(b"[1, 2]")["message"] == "request body must be a JSON object"
        huge = json.dumps({**chat, "user": "x" * limits.MAX_REQUEST_BODY_BYTES}).encode()
        error = post(huge)
        assert error["status"] == 413 and error["code"] == "request_too_large"
        # Nothing was admitted or recorded for any of them.
        with client.app.state.db.session() as session:  # type: ignore[attr-defined]
            assert list(session.scalars(select(UsageRecord))) == []


# -- the engine's verdict on an adapter ------------------------------------------------------------------


@dataclass
class Failing:
    url: str
    engine: Engine
    admin: TestClient
    headers: dict[str, str]
    adapter: dict[str, object]

    def adapter_row(self) -> dict[str, object]:
        rows = self.admin.get("/api/v1/adapters", headers=self.headers).json()
        rows = rows["adapters"] if isinstance(rows, dict) else rows
        return next(r for r in rows if r["id"] == self.adapter["id"])


@pytest.fixture
def failing(pg_url: str, app_factory: Callable[..., FastAPI], peft_dir: Path) -> Iterator[Failing]:
    with ExitStack() as stack:
        engine = Engine()
        engine_url = stack.enter_context(serve(engine.app()))
        url = stack.enter_context(serve(app_factory(pg_url)))
        admin = stack.enter_context(TestClient(app_factory(pg_url)))
        api = Api(admin)
        api.deployment("tiny", "tiny-llama", [engine_url], shape=SHAPE)
        _, headers = api.tenant_with_key("acme")
        made = upload(admin, headers, loose(peft_dir), name="poet")
        assert made.status_code == 201, made.text
        yield Failing(url, engine, admin, headers, made.json())


REASON = "adapter_model.safetensors: base_model.model.layers.0.self_attn.q_proj.lora_A.weight holds NaN"


def test_adapter_failed_marks_the_adapter_failed_and_is_a_422(failing: Failing) -> None:
    failing.engine.refuse = (422, "adapter_failed", REASON + "\x1b[31m\n")
    with httpx.Client(base_url=failing.url, headers=failing.headers, timeout=10) as client:
        response = client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "adapter_failed"
        row = failing.adapter_row()
        assert row["status"] == "failed" and row["error"] == REASON + " [31m"
        # From now on the adapter is not served: no second trip to the engine.
        again = client.post("/v1/chat/completions", json=chat())
        assert again.status_code == 422 and again.json()["error"]["code"] == "adapter_failed"
        assert REASON in again.json()["error"]["message"]  # the stored reason, said by the gateway itself
    assert len(failing.engine.received) == 1
    # The tenant's console shows why.
    make_user(failing.admin.app, "ada@acme.test", tenant="acme")  # type: ignore[arg-type]
    assert sign_in(failing.admin, "ada@acme.test").status_code == 303
    page = failing.admin.get("/console/adapters")
    assert page.status_code == 200 and REASON in page.text


def test_adapter_failed_mid_stream_is_an_sse_error_and_marks_the_adapter(failing: Failing) -> None:
    failing.engine.fail_after = (2, REASON)
    with httpx.Client(base_url=failing.url, headers=failing.headers, timeout=10) as client:
        text = client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=10)).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "adapter_failed"
    deadline = time.monotonic() + 10
    while failing.adapter_row()["status"] != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert failing.adapter_row()["error"] == REASON


def test_adapter_unavailable_is_a_503_and_marks_nothing(failing: Failing) -> None:
    failing.engine.refuse = (422, "adapter_unavailable", "the artifact store did not answer")
    with httpx.Client(base_url=failing.url, headers=failing.headers, timeout=10) as client:
        response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 503 and response.headers["Retry-After"]
    assert response.json()["error"]["code"] == "adapter_unavailable"
    assert failing.adapter_row()["status"] == "ready"


def test_a_draining_replica_s_refusal_goes_to_the_next_replica(setup: Setup) -> None:
    """A pod scaled in answers 503 not_ready until the gateway sees it leave: those requests are sent on,
    streams too, and nothing fails; with every replica draining, the client gets the 503 to retry."""
    sha = str(setup.adapter["sha256"])
    preferred, other = rendezvous_order(f"adapter:{sha}", list(setup.engines))
    setup.engines[preferred].draining = True
    with httpx.Client(base_url=setup.url, headers=setup.headers, timeout=10) as client:
        for _ in range(3):
            response = client.post("/v1/chat/completions", json=chat())
            assert response.status_code == 200, response.text
            assert response.json()["served_by"] == setup.engines[other].name
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as stream:
            assert stream.status_code == 200
            assert "data: [DONE]" in stream.read().decode()
        assert setup.engines[preferred].received, "the draining replica was asked first"
        setup.engines[other].draining = True
        refused = client.post("/v1/chat/completions", json=chat())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
