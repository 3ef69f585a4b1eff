"""The server's parts without a model: settings, OpenAI shapes, tenant labels, metrics arithmetic."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from loraplex import wire
from loraplex.engine.request import TokenLogprob
from loraplex.engine.server import protocol
from loraplex.engine.server.metrics import ServerMetrics, TenantLabels, opaque_tenant_id
from loraplex.engine.server.settings import ServerSettings, parse_adapter_arg
from loraplex.wire import AdapterRegistration, limits


def test_settings_come_from_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_NUM_PAGES", "512")
    monkeypatch.setenv("LORAPLEX_MAX_BATCH_TOKENS", "2048")
    monkeypatch.setenv("LORAPLEX_POOL_FRACTION", "0.5")
    monkeypatch.setenv("LORAPLEX_MAX_RESIDENT_ADAPTERS", "8")
    monkeypatch.setenv("LORAPLEX_INTERNAL_TOKEN", "s3cret")
    monkeypatch.setenv("LORAPLEX_MODEL_FORMAT", "gguf")  # not ours: ignored quietly
    monkeypatch.setenv("LORAPLEX_DEVICE", "cpu")
    settings = ServerSettings(num_pages=64)
    assert settings.num_pages == 64 and settings.max_batch_tokens == 2048
    assert settings.internal_token is not None and settings.internal_token.get_secret_value() == "s3cret"
    config = settings.engine_config()
    assert config.num_pages == 64 and config.gpu_memory_fraction == 0.5
    assert config.max_resident_adapters == 8 and config.device == "cpu"


def test_blank_internal_token_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_INTERNAL_TOKEN", "  ")
    assert ServerSettings().internal_token is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValidationError):
        ServerSettings(pool_fraction=1.5)
    with pytest.raises(ValidationError, match="NAME=PATH_OR_URI"):
        ServerSettings(adapters=["no-equals"])
    with pytest.raises(ValidationError, match="reserved"):
        ServerSettings(adapters=["id:x=/tmp/a"])


def test_model_names() -> None:
    # The bundled model answers to its Hugging Face id, as the control plane names it.
    assert ServerSettings().model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    bundled = "file:///models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ServerSettings(model=bundled).model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ServerSettings(model="file:///models/Llama-3.2-1B.Q4_0.gguf").model_name == "Llama-3.2-1B.Q4_0"
    assert ServerSettings(model="/models/llama-dir").model_name == "llama-dir"
    assert ServerSettings(model="/m/x.gguf", served_model_name="prod").model_name == "prod"
    assert ServerSettings(model="file:///models/x.gguf").engine_config().model == "/models/x.gguf"


def test_adapter_arguments() -> None:
    sha = "ab" * 32
    assert parse_adapter_arg("a=/x/y") == AdapterRegistration("a", "/x/y", None)
    assert parse_adapter_arg(f"a=file:///x/y@{sha.upper()}") == AdapterRegistration("a", "file:///x/y", sha)
    assert parse_adapter_arg("a=/x/y@notahash") == AdapterRegistration("a", "/x/y@notahash", None)
    stored = ServerSettings(adapter_store="file:///store")
    assert stored.resolve_adapter_uri("abc") == "file:///store/abc"
    assert stored.resolve_adapter_uri("/abs/abc") == "/abs/abc"
    assert ServerSettings().resolve_adapter_uri("rel") == "rel"


def test_tenant_labels_are_opaque_and_bounded() -> None:
    labels = TenantLabels(limit=2, key=b"key")
    a, b = opaque_tenant_id(b"key", "a"), opaque_tenant_id(b"key", "b")
    assert [labels.label(t) for t in ("a", "b", "c", "a", None)] == [a, b, "other", a, "none"]
    assert a != b and a != opaque_tenant_id(b"other key", "a")  # keyed: no label without the key


def test_engine_totals_become_counter_increments() -> None:
    from dataclasses import replace

    from loraplex.engine.stats import EngineStats

    metrics = ServerMetrics()
    pages = {"free": 6, "kv": 1, "adapter": 0, "reserved": 1}
    stats = EngineStats(8, pages, 0, 1, 3, 1, 0, 0, 2, 0, 0.5, 100, 1, 0, 1)
    metrics.observe_engine(stats)
    metrics.observe_engine(
        replace(
            stats,
            adapters_resident=2,
            adapter_loads=5,
            adapter_evictions=1,
            adapter_load_seconds=0.75,
            host_cache_hits=3,
        )
    )
    registry = metrics.registry
    assert registry.get_sample_value("loraplex_adapter_loads_total") == 5
    assert registry.get_sample_value("loraplex_adapter_evictions_total") == 1
    assert registry.get_sample_value("loraplex_adapter_load_seconds_total") == 0.75
    assert registry.get_sample_value("loraplex_adapters_resident") == 2
    assert registry.get_sample_value("loraplex_adapter_host_cache_lookups_total", {"result": "hit"}) == 3
    assert registry.get_sample_value("loraplex_adapter_host_cache_bytes") == 100
    assert registry.get_sample_value("loraplex_pool_utilization") == 0.25
    assert registry.get_sample_value("loraplex_pool_pages", {"kind": "kv"}) == 1


def test_each_app_has_its_own_registry() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.count_prompt("t", 5)
    assert first.registry.get_sample_value("loraplex_prompt_tokens_total") == 5
    assert second.registry.get_sample_value("loraplex_prompt_tokens_total") == 0


def test_refused_parameters_name_themselves() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (
        ({"functions": [{"name": "f"}]}, "functions"),
        (  # two grammars for one reply: a forced tool call and a response format
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ):
        with pytest.raises(protocol.OpenAIError) as refused:
            protocol.ChatCompletionRequest(**base, **extra).refuse_unsupported()
        assert refused.value.status == 400 and refused.value.param == param
    protocol.ChatCompletionRequest(**base, n=1, presence_penalty=0, user="u").refuse_unsupported()
    # Penalties and logit bias are served: accepted, and handed to the engine in its terms.
    penalised = protocol.ChatCompletionRequest(
        **base, presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"17": -100}
    )
    penalised.refuse_unsupported()
    params = penalised.sampling_params(8, None)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (1.5, -0.5, 1.2)
    assert params.logit_bias == {17: -100.0}
    for extra, param in (
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ):
        with pytest.raises(ValidationError) as capped:
            protocol.ChatCompletionRequest(**base, **extra)
        cause = capped.value.errors()[0]["ctx"]["error"]
        assert isinstance(cause, limits.LimitExceeded) and cause.param == param
    # Over a cap of limits.py: refused while parsing, the cause naming the field (app.py answers 400).
    with pytest.raises(ValidationError) as capped:
        protocol.ChatCompletionRequest(**base, n=limits.MAX_CHOICES + 1)
    cause = capped.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, limits.LimitExceeded) and cause.param == "n"


def test_prompts_and_messages() -> None:
    def prompts(value: object) -> object:
        return protocol.CompletionRequest(model="m", prompt=value).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["hi"]) == ["hi"]
    assert prompts(["12"]) == ["12"]  # a list of one text stays text
    assert prompts([[3, 4]]) == [[3, 4]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[3], [4, 5]]) == [[3], [4, 5]]
    with pytest.raises(protocol.OpenAIError, match="prompt is empty"):
        prompts([])
    chat = protocol.ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ],
    )
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    image = protocol.ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    )
    with pytest.raises(protocol.OpenAIError, match="only text parts"):
        image.template_messages()


def test_stream_chunks_follow_openai() -> None:
    chunks = protocol.ChunkMaker(chat=True, model="m", include_usage=True)
    role, text = chunks.role(), chunks.text("Hi")
    final, usage = chunks.text("", None, "length"), chunks.usage(protocol.usage(3, 2))
    assert role["object"] == "chat.completion.chunk" and role["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    assert text["choices"][0]["delta"] == {"content": "Hi"} and text["usage"] is None
    assert final["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert protocol.usage(40, 2, 32)["prompt_tokens_details"] == {"cached_tokens": 32}
    assert len({c["id"] for c in (role, text, final, usage)}) == 1
    assert protocol.sse(text).startswith(b"data: {") and protocol.sse(text).endswith(b"}\n\n")
    plain = protocol.ChunkMaker(chat=False, model="m", include_usage=False).text("x")
    assert plain["object"] == "text_completion" and "usage" not in plain
    assert plain["choices"][0] == {"index": 0, "text": "x", "logprobs": None, "finish_reason": None}


def test_logprobs_shapes() -> None:
    entries = [TokenLogprob(1, -0.5, [(1, -0.5), (2, float("-inf"))]), TokenLogprob(2, -1.0, [])]
    names = {1: "ab", 2: "é"}
    chat = protocol.chat_logprobs(entries, names.__getitem__)
    assert chat["content"][0]["top_logprobs"][1] == {"token": "é", "logprob": -9999.0, "bytes": [195, 169]}
    json.dumps(chat, allow_nan=False)  # no -inf reaches JSON
    legacy, offset = protocol.completion_logprobs(entries, names.__getitem__, 10)
    assert legacy["text_offset"] == [10, 12] and offset == 13
    assert legacy["top_logprobs"][0] == {"ab": -0.5, "é": -9999.0}


def test_engine_failures_map_to_the_wire_contract() -> None:
    """Whose fault it was decides the answer: the adapter's (422 adapter_failed, the gateway marks it
    failed), its store's (503 adapter_unavailable, retry), or the engine's (500 engine_error)."""
    from loraplex.engine.engine import FailedOutput
    from loraplex.engine.request import RequestOutput
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.server.choices import Job, Prompt
    from loraplex.engine.server.delivery import output_failure
    from loraplex.wire.errors import AdapterUnavailable, RefusedAdapterError, failure_error

    job = Job(False, "mine", "id:1", [Prompt([1], SamplingParams())], False, False, wire.TenantRef("t"))
    fields = dict(request_id="r", prompt=None, prompt_token_ids=[1], token_ids=[], text="", finished=True)

    def answer(code: str | None) -> protocol.OpenAIError | None:
        output = (
            RequestOutput(**fields, finish_reason="error", error="why")
            if code is None
            else FailedOutput(**fields, finish_reason="error", error="why", error_code=code)
        )
        return output_failure(output, job)

    expected = {
        "adapter_failed": (422, None),
        "adapter_unavailable": (503, "1"),
        "engine_error": (500, None),
        None: (500, None),
    }
    for code, (status, retry_after) in expected.items():
        error = answer(code)
        assert error is not None and error.status == status and error.message == "why"
        assert error.code == (code or "engine_error")
        assert (error.headers or {}).get("Retry-After") == retry_after
    done = RequestOutput(**fields, finish_reason="stop")
    assert output_failure(done, job) is None
    refused = failure_error(RefusedAdapterError("bad"))
    assert refused.code == "adapter_failed" and refused.status == 422 and refused.message == "bad"
    assert failure_error(AdapterUnavailable("down")).status == 503
