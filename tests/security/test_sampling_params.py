"""Sampling parameters: every number bounded before the sampler, and sampling inside each request's fault
domain.

The attack (issue 29, found 2026-11-27): neither the gateway nor the engine bounded `top_k`. 2**63-1
overflowed in the sampler (float32, then .long()) and 10**400 raised OverflowError; the retry path sampled
outside the fault isolation, so the error escaped the step and the server failed every running request of
every tenant: another tenant's stream ended mid-way with an `engine_error` quoting the attacker's error.

Two defences, each tested on its own:
- every numeric field has one range in wire/limits.py, checked by the gateway, the engine's
  request schema and SamplingParams (properties over arbitrary JSON values, and over HTTP against a
  running engine whose sampler records what reaches it);
- a row that fails to sample ends that request alone, on the plain, pipelined and retry paths, shown with
  hostile values set past every check (the fuzz test: random parameter sets beside a fixed victim).

LORAPLEX_FUZZ_EXAMPLES sets the examples per property (default 40); a longer run is in docs/security.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import loraplex.engine.runner as runner_module  # where the engine samples
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.engine import FailedOutput
from loraplex.engine.request import RequestOutput
from loraplex.engine.server import protocol
from loraplex.engine.server.app import create_app
from loraplex.engine.server.settings import ServerSettings
from loraplex.web.services import gateway
from loraplex.wire import limits
from tests.engine.server.conftest import INTERNAL, TOKEN, Server, serving
from tests.web.conftest import SHAPE, Api, app_factory, sqlite_template, sqlite_url  # noqa: F401
from tests.web.servers import serve

from .engine_stub import Engine as StubEngine

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
VOCAB = 512  # random:tiny's

# The exploit's values, and others at and past every edge the sampler has: int64, uint64, float32's exact
# integers (2**24), float range, denormals, and each field's own bounds.
HOSTILE_NUMBERS: list[float] = [
    2**63 - 1, 2**63, 2**64, 2**64 - 1, -(2**63), -(2**63) - 1, 10**400, -(10**400), 2**31, 2**24 + 1,
    VOCAB, VOCAB + 1, limits.MAX_TOP_K, limits.MAX_TOP_K + 1, 1e308, -1e308, 5e-324, 1e-300, -0.0, 0, -1,
    1, 0.5, 2.0, 2.0000001, 20, 21, 65536, 65537, float("nan"), float("inf"), float("-inf"),
]  # fmt: skip
NUMERIC_FIELDS = [
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "best_of",
    "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(HOSTILE_NUMBERS)
    | st.sampled_from(HOSTILE_NUMBERS).map(str)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)
# Mostly numbers (where the danger is), then anything JSON can hold.
field_values = st.one_of(
    st.sampled_from(HOSTILE_NUMBERS),
    st.integers(),
    st.floats(),
    st.sampled_from(HOSTILE_NUMBERS).map(str),
    json_values,
)
numeric_fields = st.dictionaries(st.sampled_from(NUMERIC_FIELDS), field_values, min_size=1, max_size=4)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are microseconds of work: a second intra-op thread only adds synchronisation
    (10x slower per step on a busy two-core host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def is_number(value: object, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or (not integer and math.isfinite(value))


# What the sampler can take without overflowing or indexing out of range, stated from its representation
# (settings packed as float32, top-k taken as int64, topk over the vocabulary, seeds as torch's), not from
# limits.py: the test's own statement of "bounded".
def assert_bounded_json(body: dict[str, Any], endpoint: str) -> None:
    """A body the gateway forwards: each numeric field absent or a bounded number of the right kind."""

    def bounded(name: str, low: float, high: float, integer: bool = False) -> None:
        value = body.get(name)
        if value is None:
            return
        assert is_number(value, integer) and low <= value <= high, (name, value)

    bounded("top_k", -1, 2**24, integer=True)
    bounded("temperature", 0, 2)
    bounded("top_p", 0, 1)
    assert body.get("top_p") != 0
    bounded("min_p", 0, 1)
    bounded("seed", -(2**63), 2**64 - 1, integer=True)
    bounded("max_tokens", 1, limits.MAX_COMPLETION_TOKENS, integer=True)
    bounded("max_completion_tokens", 1, limits.MAX_COMPLETION_TOKENS, integer=True)
    bounded("n", 1, limits.MAX_CHOICES, integer=True)
    bounded("best_of", 1, limits.MAX_BEST_OF, integer=True)
    bounded("top_logprobs", 0, 20, integer=True)
    bounded("presence_penalty", -2, 2)
    bounded("frequency_penalty", -2, 2)
    bounded("repetition_penalty", 0.01, 10)  # a logit divided by it grows at most 100-fold: finite
    if endpoint == "completions":
        bounded("logprobs", 0, 20, integer=True)


def assert_bounded(params: SamplingParams, vocab: int = 2**24) -> None:
    """SamplingParams that reach the sampler: every number of its kind and inside what it can take."""
    assert type(params.top_k) is int and 0 <= params.top_k <= vocab, params.top_k
    assert is_number(params.temperature) and 0 <= params.temperature <= 2, params.temperature
    assert is_number(params.top_p) and 0 < params.top_p <= 1, params.top_p
    assert is_number(params.min_p) and 0 <= params.min_p <= 1, params.min_p
    assert params.seed is None or (type(params.seed) is int and -(2**63) <= params.seed < 2**64)
    assert type(params.max_tokens) is int and 1 <= params.max_tokens <= limits.MAX_COMPLETION_TOKENS
    assert params.logprobs is None or (
        type(params.logprobs) is int and 0 <= params.logprobs <= min(20, vocab)
    )
    assert is_number(params.presence_penalty) and -2 <= params.presence_penalty <= 2
    assert is_number(params.frequency_penalty) and -2 <= params.frequency_penalty <= 2
    assert is_number(params.repetition_penalty) and 0.01 <= params.repetition_penalty <= 10
    for token, bias in (params.logit_bias or {}).items():  # indices into the logits, values added to them
        assert type(token) is int and 0 <= token < vocab and is_number(bias) and -100 <= bias <= 100


def named_field(exc: Exception) -> str | None:
    """The field a refusal names, as the client would read it in the error's `param`."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, limits.LimitExceeded):
            return cause.param
        return str(first["loc"][0]) if first["loc"] else None
    return getattr(exc, "param", None)


def request_body(endpoint: str, fields: dict[str, Any]) -> dict[str, Any]:
    if endpoint == "completions":
        return {"model": "tiny", "prompt": [1, 2, 3], **fields}
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


# -- 1. no value of any field reaches the sampler unbounded --------------------------------------------------


@FUZZ
@given(endpoint=st.sampled_from(["completions", "chat/completions"]), fields=numeric_fields)
def test_the_gateway_forwards_no_unbounded_number(endpoint: str, fields: dict[str, Any]) -> None:
    """Any JSON value in any numeric field, through the gateway's parser and caps: refused with a 400
    naming a field it was given, or every number forwarded is bounded."""
    raw = json.dumps(request_body(endpoint, fields)).encode()
    try:
        body = gateway.parse_body(raw)
        gateway.check_caps(body, endpoint)
    except gateway.BadRequest as refused:
        assert refused.status == 400
        assert refused.param is None or refused.param in fields, (refused.param, refused.message)
        assert refused.param is not None or "JSON" in refused.message  # NaN, Infinity: not JSON
        return
    assert_bounded_json(body, endpoint)


@FUZZ
@given(endpoint=st.sampled_from(["completions", "chat/completions"]), fields=numeric_fields)
def test_the_engine_schema_makes_no_unbounded_sampling_params(endpoint: str, fields: dict[str, Any]) -> None:
    """The same values straight into the engine's request schema (what a caller that skips the gateway
    sends): refused naming a field it was given, or the SamplingParams it makes are bounded."""
    body = request_body(endpoint, fields)
    try:
        if endpoint == "completions":
            completion = protocol.CompletionRequest.model_validate(body)
            completion.refuse_unsupported()
            params = completion.sampling_params(completion.max_tokens or 16, completion.logprobs)
        else:
            chat = protocol.ChatCompletionRequest.model_validate(body)
            chat.refuse_unsupported()
            params = chat.sampling_params(chat.token_limit or 16, chat.logprobs_wanted)
    except (ValidationError, protocol.OpenAIError, limits.LimitExceeded) as refused:
        assert getattr(refused, "status", 400) == 400
        assert named_field(refused) in fields, (named_field(refused), refused)
        return
    assert_bounded(params)


@dataclass
class Recorded:
    """A running engine server on a tiny random model, with what its sampler was handed."""

    server: Server
    sampled: list[SamplingParams]

    def post(self, body: dict[str, Any] | bytes, timeout: float = 60) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**INTERNAL, "Content-Type": "application/json"}
        return httpx.post(
            f"{self.server.url}/v1/completions", content=content, headers=headers, timeout=timeout
        )

    def step_errors(self) -> float:
        value = self.server.state.metrics.registry.get_sample_value("loraplex_engine_step_errors_total")
        return value or 0.0


def tiny_engine(**config: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model="random:tiny", device="cpu", num_pages=128, max_model_len=64, **config)
    )


@pytest.fixture(scope="module")
def recorded() -> Iterator[Recorded]:
    sampled: list[SamplingParams] = []
    real = runner_module.sample_step

    def recording(logits: Any, requests: Any, *args: Any, **kwargs: Any) -> Any:
        sampled.extend(r.params for r in requests)
        return real(logits, requests, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "sample_step", recording)
        app = create_app(
            ServerSettings(internal_token=TOKEN, served_model_name="tiny", max_queue=64), tiny_engine
        )
        with serving(app) as url:
            yield Recorded(Server(url, app.state.server), sampled)


@FUZZ
@given(fields=numeric_fields)
def test_no_number_reaches_a_running_engine_s_sampler_unbounded(
    recorded: Recorded, fields: dict[str, Any]
) -> None:
    """Over HTTP, into a running engine: a 400 naming a field that was sent, or a 200 whose every
    SamplingParams the sampler saw is bounded (top_k and logprobs by the model's vocabulary too). Never a
    5xx, never a step error."""
    recorded.sampled.clear()
    fields.pop("max_completion_tokens", None)  # not a /v1/completions field: a 400 the gateway gives
    response = recorded.post(request_body("completions", {"max_tokens": 2, **fields}))
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["param"] in {*fields, "max_tokens"} and error["type"] == "invalid_request_error", error
        return
    assert recorded.sampled, "a request that was answered was sampled"
    for params in recorded.sampled:
        assert_bounded(params, VOCAB)
    assert recorded.step_errors() == 0


def test_the_offline_api_refuses_the_exploit_s_values() -> None:
    """SamplingParams (what the engine's own callers build) and add_request: the same bounds, the vocabulary
    on top, each a LimitExceeded naming the field."""
    for field, value in [("top_k", 2**63 - 1), ("top_k", 10**400), ("temperature", 10**400), ("seed", 2**64)]:
        with pytest.raises(limits.LimitExceeded) as refused:
            SamplingParams(**{field: value})
        assert refused.value.param == field
    engine = tiny_engine()
    with pytest.raises(limits.LimitExceeded, match="vocabulary") as over:
        engine.add_request([1, 2, 3], SamplingParams(top_k=VOCAB + 1))
    assert over.value.param == "top_k"
    assert not engine.has_unfinished()


# -- 2. a row that fails to sample fails that request alone -------------------------------------------------

VICTIM_PROMPT = [17, 300, 5, 99, 42]
VICTIM = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Hostile values set on a request's SamplingParams after it was queued: past SamplingParams' checks and the
# engine's vocabulary check, as a bug in either would let them through.
BYPASS_FIELDS = [
    "top_k", "temperature", "top_p", "min_p", "logprobs", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
]  # fmt: skip
# The paths a step's sampling takes: the plain loop, the pipelined one (async scheduling: a launch that
# raises lands the step in flight, then runs the plain way), and each of them with a forward that fails
# once every few calls (the retry: the step's forward runs again, then samples).
PATHS = ["plain", "pipelined", "retry-plain", "retry-pipelined"]


@dataclass
class Bench:
    engine: LLMEngine
    expected: list[int]  # the victim's tokens, alone


def make_bench(path: str) -> Bench:
    engine = tiny_engine(async_scheduling="on" if path.endswith("pipelined") else "off")
    expected = engine.generate([VICTIM_PROMPT], VICTIM)[0].token_ids
    if path.startswith("retry"):
        real, calls = engine.runner.execute, [0]

        def flaky(batch: Any) -> Any:
            calls[0] += 1
            if calls[0] % 3 == 0:  # never twice in a row: the retry succeeds
                raise RuntimeError("a transient device error")
            return real(batch)

        engine.runner.execute = flaky  # type: ignore[method-assign]
    return Bench(engine, expected)


@pytest.fixture(scope="module")
def benches() -> dict[str, Bench]:
    return {path: make_bench(path) for path in PATHS}


@dataclass(frozen=True)
class Attacker:
    prompt: list[int]
    params: SamplingParams
    bypass: tuple[tuple[str, Any], ...]  # (field, value) set after the request is queued


Outcome = RequestOutput | ValueError  # its last output, or the error add_request refused it with


def run_beside_victim(bench: Bench, attackers: list[Attacker]) -> tuple[RequestOutput, list[Outcome]]:
    """Queue the victim and the attackers, step to the end (a step must never raise); the victim's output
    and each attacker's outcome, in order."""
    engine = bench.engine
    victim = engine.add_request(VICTIM_PROMPT, VICTIM)
    queued: list[str | ValueError] = []
    for attacker in attackers:
        try:
            queued.append(engine.add_request(attacker.prompt, attacker.params))
        except ValueError as refused:
            queued.append(refused)
            continue
        for field, value in attacker.bypass:
            object.__setattr__(attacker.params, field, value)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert engine.pool.pages_by_kind()["kv"] == 0  # every request's pages went back
    return finished[victim], [q if isinstance(q, ValueError) else finished[q] for q in queued]


def assert_only_attackers_failed(
    bench: Bench, victim: RequestOutput, attackers: list[Attacker], outcomes: list[Outcome]
) -> None:
    """The victim got its tokens alone; an attacker was refused up front (a LimitExceeded naming the
    field), finished, or, only if it carried hostile values, ended alone with engine_error."""
    assert victim.finish_reason == "length" and victim.error is None, victim.error
    assert victim.token_ids == bench.expected
    for attacker, outcome in zip(attackers, outcomes, strict=True):
        if isinstance(outcome, ValueError):
            assert isinstance(outcome, limits.LimitExceeded), outcome
            continue
        assert outcome.finished
        if outcome.finish_reason == "error":
            assert attacker.bypass, f"valid parameters failed: {attacker.params}: {outcome.error}"
            assert isinstance(outcome, FailedOutput) and outcome.error_code == "engine_error"
            assert outcome.error is not None and "sampling failed" in outcome.error


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 10**400), ("logprobs", 10**6), ("logprobs", 0.5), ("temperature", float("nan")),
        ("presence_penalty", 10**400), ("repetition_penalty", -(10**400)),
    ],
    ids=[
        "top_k-10**400", "logprobs-10**6", "logprobs-0.5", "temperature-nan-greedy", "presence-10**400",
        "repetition--10**400",
    ],
)  # fmt: skip
def test_a_row_that_cannot_be_sampled_ends_only_its_request(
    benches: dict[str, Bench], path: str, field: str, value: float
) -> None:
    """Values the sampler cannot take, set past every check (10**400 overflows float32, a penalty's too,
    a logprob count past the vocabulary or not an integer fails topk, a greedy request made to sample has
    no seed): the attacker ends with engine_error saying sampling failed, the victim beside it gets its
    tokens alone."""
    bench = benches[path]
    greedy = field == "temperature"  # made to sample after it was queued greedy, without a generator
    params = SamplingParams(max_tokens=6, temperature=0.0 if greedy else 0.8, seed=3)
    attacker = Attacker([6, 7, 8], params, ((field, value),))
    victim, outcomes = run_beside_victim(bench, [attacker])
    assert_only_attackers_failed(bench, victim, [attacker], outcomes)
    (outcome,) = outcomes
    assert isinstance(outcome, FailedOutput) and outcome.finish_reason == "error"


valid_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 8),
    temperature=st.sampled_from([0.0, 1.0, 2.0]) | st.floats(0.0, limits.MAX_TEMPERATURE),
    top_k=st.sampled_from([0, 1, VOCAB, VOCAB + 1, limits.MAX_TOP_K]) | st.integers(0, VOCAB),
    top_p=st.sampled_from([1.0, 1e-9]) | st.floats(0.0, 1.0, exclude_min=True),
    min_p=st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0),
    seed=st.none() | st.sampled_from([-(2**63), 2**64 - 1]) | st.integers(-(2**63), 2**64 - 1),
    logprobs=st.none() | st.integers(0, limits.MAX_LOGPROBS),
    ignore_eos=st.booleans(),
    # Penalised rows beside the victim: its tokens must not move (engine/penalties.py changes a row alone).
    presence_penalty=st.sampled_from([0.0, -2.0, 2.0]) | st.floats(-2.0, 2.0),
    frequency_penalty=st.sampled_from([0.0, -2.0, 2.0]) | st.floats(-2.0, 2.0),
    repetition_penalty=st.sampled_from([1.0, 0.01, 10.0]) | st.floats(0.01, 10.0),
    logit_bias=st.none() | st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0), max_size=4),
)
bypass = st.lists(
    st.tuples(st.sampled_from(BYPASS_FIELDS), st.sampled_from(HOSTILE_NUMBERS)),
    max_size=2,
    unique_by=lambda t: t[0],
)
attackers = st.lists(
    st.builds(Attacker, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), valid_params,
              bypass.map(tuple)),
    min_size=1, max_size=3,
)  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_random_parameter_sets_never_change_the_victim_s_output(benches: dict[str, Bench], path: str) -> None:
    """The fuzz test: up to three requests with random sampling parameters (valid ones across their whole
    ranges; hostile values set past every check) beside a greedy victim. The victim's tokens are what it
    gets alone; a valid attacker finishes normally; a hostile one finishes or ends alone with engine_error."""
    bench = benches[path]

    @FUZZ
    @given(attackers)
    def check(group: list[Attacker]) -> None:
        victim, outcomes = run_beside_victim(bench, group)
        assert_only_attackers_failed(bench, victim, group, outcomes)
        for outcome in outcomes:  # what the examples covered (--hypothesis-show-statistics)
            event("refused" if isinstance(outcome, ValueError) else f"finished: {outcome.finish_reason}")

    check()


# -- 3. the original exploit through the HTTP API ----------------------------------------------------------


def alone(recorded: Recorded, body: dict[str, Any]) -> str:
    response = recorded.post(body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def stream_text(recorded: Recorded, body: dict[str, Any]) -> str:
    """A streamed completion's text; an error event mid-stream fails the test with its message."""
    text = []
    headers = {**INTERNAL, "Content-Type": "application/json"}
    url = f"{recorded.server.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.extend(c["text"] for c in event["choices"])
    return "".join(text)


EXPLOIT = [b"9223372036854775807", b"1" + b"0" * 400]  # 2**63-1 and 10**400, as a client writes them


def test_the_exploit_through_the_engine_api_fails_only_the_attacker(recorded: Recorded) -> None:
    """A victim streams 40 tokens while the attacker sends top_k 2**63-1 and 10**400: each attack is a 400
    naming top_k; the victim's stream is whole and as it is alone; no step failed; /ready stays on."""
    victim = {
        "model": "tiny",
        "prompt": VICTIM_PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    expected = alone(recorded, victim)
    errors_before = recorded.step_errors()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        streamed = pool.submit(stream_text, recorded, victim)
        attacks = [
            pool.submit(
                recorded.post,
                b'{"model": "tiny", "prompt": [6, 7, 8], "max_tokens": 30, "top_k": ' + n + b"}",
            )
            for n in EXPLOIT * 2
        ]
        for attack in attacks:
            refused = attack.result()
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "top_k" and error["code"] == "limit_exceeded", error
            assert error["type"] == "invalid_request_error" and "top_k must be" in error["message"]
        assert streamed.result() == expected
    assert recorded.step_errors() == errors_before
    assert httpx.get(f"{recorded.server.url}/ready", timeout=10).status_code == 200


def test_past_validation_the_exploit_still_fails_only_the_attacker(recorded: Recorded) -> None:
    """Defence in depth: with every check of the value switched off (the schema, SamplingParams and the
    vocabulary check), the exploit reaches the sampler. 2**63-1 is clamped to the vocabulary there (no
    overflow: the attacker is answered); 10**400 cannot be packed, and the attacker's request alone fails
    (500 engine_error saying sampling failed). The victim's stream is unchanged; no step failed."""
    victim = {
        "model": "tiny",
        "prompt": VICTIM_PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    expected = alone(recorded, victim)
    errors_before = recorded.step_errors()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(limits, "check_number", lambda *args, **kwargs: None)
        patch.setattr(LLMEngine, "_check_sampling", lambda self, params: None)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streamed = pool.submit(stream_text, recorded, victim)
            body = b'{"model": "tiny", "prompt": [6, 7, 8], "max_tokens": 30, "temperature": 0.9, "top_k": '
            clamped, overflowing = (pool.submit(recorded.post, body + n + b"}") for n in EXPLOIT)
            assert clamped.result().status_code == 200, clamped.result().text
            failed = overflowing.result()
            assert failed.status_code == 500, failed.text
            error = failed.json()["error"]
            assert error["code"] == "engine_error" and "sampling failed" in error["message"], error
            assert streamed.result() == expected
    assert recorded.step_errors() == errors_before
    assert httpx.get(f"{recorded.server.url}/ready", timeout=10).status_code == 200


def test_the_exploit_through_the_gateway_is_refused_before_it_is_forwarded(
    sqlite_url: str,  # noqa: F811
    app_factory: Callable[..., FastAPI],  # noqa: F811
) -> None:
    """The gateway refuses top_k 2**63-1 and 10**400 (chat and completions) with a 400 naming top_k and
    forwards nothing of them; the next tenant's request is forwarded and answered."""
    with ExitStack() as stack:
        engine = StubEngine()
        engine_url = stack.enter_context(serve(engine.app()))
        client = stack.enter_context(TestClient(app_factory(sqlite_url)))
        api = Api(client)
        api.deployment("tiny", "tiny-llama", [engine_url], shape=SHAPE)
        _, mallory = api.tenant_with_key("mallory")
        _, alice = api.tenant_with_key("alice")
        headers = {**mallory, "Content-Type": "application/json"}
        for number in EXPLOIT:
            for path, body in (
                ("/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "top_k": '),
                (
                    "/v1/chat/completions",
                    b'{"model": "tiny-llama", "messages": [{"role": "user"}], "top_k": ',
                ),
            ):
                refused = client.post(path, content=body + number + b"}", headers=headers)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["param"] == "top_k" and error["type"] == "invalid_request_error", error
                assert "top_k must be" in error["message"]
        assert engine.received == []
        served = client.post(
            "/v1/completions",
            json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3, "top_k": 40},
            headers=alice,
        )
        assert served.status_code == 200, served.text
        assert [r["body"]["top_k"] for r in engine.received] == [40]
