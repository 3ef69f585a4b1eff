"""The engine's offline API: continuous batching, chunked prefill, aborts, errors, dtypes."""

from __future__ import annotations

import pytest

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def engine(smollm2) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32"), loaded=smollm2)


def test_requests_joining_mid_run_get_the_same_tokens_as_alone(engine: LLMEngine) -> None:
    prompts = ["The history of Rome", "A recipe for bread:", "My favourite colour is"]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    first = engine.add_request(prompts[0], GREEDY)
    results = {}
    late: list[str] = []
    for step in range(100):
        if step in (2, 5):
            late.append(engine.add_request(prompts[len(late) + 1], GREEDY))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        if not engine.has_unfinished() and len(late) == 2:
            break
    assert [results[i] for i in [first, *late]] == alone
    assert engine.pool.pages_by_kind()["kv"] == 0


def test_chunked_prefill_gives_the_same_tokens(smollm2, engine: LLMEngine) -> None:
    prompt = "Tell me about the ocean. " * 12
    whole = engine.generate([prompt], GREEDY)[0].token_ids
    chunked = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", max_batch_tokens=16, max_num_seqs=4, num_pages=64),
        loaded=smollm2,
    )
    assert chunked.generate([prompt], GREEDY)[0].token_ids == whole


def test_abort_frees_pages(engine: LLMEngine) -> None:
    request_id = engine.add_request("Write a long essay about trees.", SamplingParams(max_tokens=200))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free < engine.pool.num_pages
    engine.abort(request_id)
    assert engine.pool.pages_by_kind()["kv"] == 0 and not engine.has_unfinished()


def test_streamed_deltas_add_up_to_the_text(engine: LLMEngine) -> None:
    engine.add_request("Emoji of the day: ", SamplingParams(max_tokens=20, temperature=0.0))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert final is not None and "".join(pieces) == final.text


def test_bad_requests_are_refused_with_a_reason(smollm2, engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 49152], GREEDY)
    with pytest.raises(ValueError, match="context holds"):
        engine.add_request([5] * engine.max_model_len, GREEDY)
    small = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_pages=3, page_size=4), loaded=smollm2)
    with pytest.raises(ValueError, match="pool has 2"):
        small.add_request([5] * 6, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        engine.generate(["a", "b"], [GREEDY])


def test_engine_config_is_validated() -> None:
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EngineConfig(max_batch_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")


def test_random_weights_model_takes_token_ids() -> None:
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_pages=32))
    outputs = engine.generate(
        [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text", GREEDY)


def test_bfloat16_engine_answers_sensibly(smollm2) -> None:
    from loraplex.engine.model.loader import load_model

    loaded = load_model(None, dtype=__import__("torch").bfloat16)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16"), loaded=loaded)
    out = engine.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=20, temperature=0.0),
    )
    assert "Paris" in out.text


def test_streamed_deltas_never_show_a_cut_stop_string(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine.add_request(ids, SamplingParams(max_tokens=40, temperature=0.0, stop=("is Par",)))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert final is not None and final.finish_reason == "stop"
    assert "".join(pieces) == final.text == "The capital of France "
