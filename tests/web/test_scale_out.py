"""Issue 26, "the same spread with plain endpoint URLs": `loraplex control-plane` and three `loraplex serve`
processes on one machine, one deployment naming the three URLs, one tenant with 21 adapters. One adapter
is flooded beside a trickle to the 20 quiet ones. What each engine says it did is the evidence (GET
/internal/adapters behind the internal token: per adapter, the requests admitted there, those that waited
for a load, and the loads), not what the gateway believes it sent:
- the flooded adapter was served by at least two engines, each quiet adapter by exactly one, and every
  request was answered;
- every engine the flooded adapter's replica set grew to had it loaded before its first request there (a
  prewarm): one load, and no request on that engine waited for it.

The engines run a tiny random model (with a byte-level tokenizer) on one CPU thread each, so the whole run
fits a 2-core machine under load; the pod's saturation is set low (LORAPLEX_PLACEMENT_SATURATION) so the
flood fills a pod in a few requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex import wire
from tests.security.adapter_files import lora_tensors, weights_bytes, write_adapter

from .conftest import SHAPE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LORAPLEX = str(Path(sys.executable).with_name("loraplex"))
ADMIN = {"Authorization": "Bearer scale-out-admin-token"}
INTERNAL_TOKEN = "scale-out-internal-token"
BASE_MODEL = "tiny-llama"
ENGINES = 3
QUIET = 20
# A pod with this many of the gateway's requests outstanding is saturated. A set grows only for an adapter
# with at least 2 requests outstanding per member (PlacementPolicy.per_member), so a quiet adapter (one
# request at a time) never grows, while the flood (FLOOD_WORKERS at once) fills its first pod at once.
SATURATION = 6
FLOOD_WORKERS = 18
FLOOD_REQUESTS_EACH = 8
QUIET_WORKERS = 4
QUIET_ROUNDS = 2
MAX_TOKENS = 16
START_TIMEOUT_S = 240.0


def tiny_model(directory: Path) -> Path:
    """A Hugging Face directory of a tiny random Llama (the adapters' SHAPE) with a byte-level tokenizer:
    the gateway takes text prompts, and `random:tiny` has no tokenizer. 256 byte tokens and an end token."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    vocab, hidden, inter = len(alphabet) + 1, SHAPE["hidden_size"], SHAPE["intermediate_size"]
    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    assert (heads * head_dim, kv_heads * head_dim) == (SHAPE["q_size"], SHAPE["kv_size"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": SHAPE["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": vocab - 1,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.05, shape).astype("f4")

    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": np.ones(hidden, "f4"),
        "lm_head.weight": normal(vocab, hidden),
    }
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for layer in range(SHAPE["num_layers"]):
        prefix = f"model.layers.{layer}"
        for name, shape in shapes.items():
            tensors[f"{prefix}.{name}.weight"] = normal(*shape)
        tensors[f"{prefix}.input_layernorm.weight"] = np.ones(hidden, "f4")
        tensors[f"{prefix}.post_attention_layernorm.weight"] = np.ones(hidden, "f4")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """One `loraplex` command, its output in a log file (shown when it fails)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path):
        self.name, self.log = name, logs / f"{name}.log"
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                [LORAPLEX, *argv], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
            )

    def tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- {self.name} (exit {self.popen.poll()}) ---\n" + "\n".join(text)

    def wait_until(self, url: str, deadline: float) -> None:
        """Until GET `url` answers 200; fails with the log's end if the process exits or time runs out."""
        while True:
            assert self.popen.poll() is None, f"{self.name} exited early\n{self.tail()}"
            with suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            assert time.monotonic() < deadline, f"{self.name} was not ready in time\n{self.tail()}"
            time.sleep(0.25)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


@dataclass
class Platform:
    url: str
    engines: list[str]
    processes: list[Process]

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.processes)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("scale-out")
    store = root / "store"
    store.mkdir()
    model = tiny_model(root / "model")
    # One CPU thread per engine: three engines and the control plane share a small machine.
    common = {"LORAPLEX_INTERNAL_TOKEN": INTERNAL_TOKEN, "LORAPLEX_ADAPTER_STORE": str(store)}
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with ExitStack() as stack:
        processes: list[Process] = []
        engines = []
        for i in range(ENGINES):
            port = free_port()
            argv = ["serve", "--model", str(model), "--served-model-name", BASE_MODEL, "--device", "cpu"]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--num-pages", "512", "--max-num-seqs", "8"]
            # Routing is what this tests, not decode speed: three engines compiling their decode step at
            # once on an empty Inductor cache cost ~60 CPU-s (serve's default on the CPU, issue 30).
            argv += ["--no-compile-decode"]
            process = Process(f"engine-{i}", argv, {**common, **threads}, root)
            stack.callback(process.stop)
            processes.append(process)
            engines.append(f"http://127.0.0.1:{port}")
        port = free_port()
        control_plane = {
            **common,
            "LORAPLEX_DATA_DIR": str(root / "data"),
            "LORAPLEX_ADMIN_TOKEN": ADMIN["Authorization"][7:],
            "LORAPLEX_KEY_PEPPER": "scale-out-pepper",
            "LORAPLEX_ALLOW_LOOPBACK_ENDPOINTS": "true",  # the engines listen on 127.0.0.1
            "LORAPLEX_PLACEMENT_SATURATION": str(SATURATION),
            # The flood is one tenant's and one key's: room for all of it at once.
            "LORAPLEX_TENANT_MAX_IN_FLIGHT": "128",
            "LORAPLEX_KEY_MAX_IN_FLIGHT": "128",
        }
        process = Process("control-plane", ["control-plane", "--port", str(port)], control_plane, root)
        stack.callback(process.stop)
        processes.append(process)
        deadline = time.monotonic() + START_TIMEOUT_S
        for process, engine in zip(processes, engines, strict=False):
            process.wait_until(f"{engine}/ready", deadline)
        url = f"http://127.0.0.1:{port}"
        processes[-1].wait_until(f"{url}/health", deadline)
        yield Platform(url, engines, processes)


def set_up_tenant(platform: Platform, root: Path) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """A deployment on the three engine URLs, a tenant, its key and 21 distinct adapters."""
    with httpx.Client(base_url=platform.url, timeout=60) as admin:
        made = admin.post(
            "/admin/v1/deployments",
            json={"name": "tiny", "base_model": BASE_MODEL, "endpoints": platform.engines, "shape": SHAPE},
            headers=ADMIN,
        )
        assert made.status_code == 201, made.text
        tenant = admin.post("/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN)
        assert tenant.status_code == 201, tenant.text
        key = admin.post(f"/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "k"}, headers=ADMIN)
        assert key.status_code == 201, key.text
        auth = {"Authorization": f"Bearer {key.json()['key']}"}
        adapters = []
        for i in range(QUIET + 1):
            directory = write_adapter(root / f"a{i}", weights=weights_bytes(lora_tensors(seed=i)))
            files = [
                ("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in directory.iterdir()
            ]
            uploaded = admin.post(
                "/api/v1/adapters", data={"name": f"a{i}", "deployment": "tiny"}, files=files, headers=auth
            )
            assert uploaded.status_code == 201 and uploaded.json()["status"] == "ready", uploaded.text
            adapters.append(uploaded.json())
    return auth, adapters


async def complete(client: httpx.AsyncClient, model: str, seed: int) -> tuple[str, int, str]:
    body = {
        "model": model,
        "prompt": f"Tell me about item {seed}.",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,  # every request decodes MAX_TOKENS: the flood's load does not hang on luck
        "temperature": 0,
    }
    answer = await client.post("/v1/completions", json=body)
    return model, answer.status_code, answer.text


async def flood_and_trickle(
    url: str, auth: dict[str, str], hot: str, quiet: list[str]
) -> list[tuple[str, int, str]]:
    """FLOOD_WORKERS clients asking for `hot` back to back, beside QUIET_WORKERS clients going round the
    quiet adapters one request at a time, until the flood is over and each was asked QUIET_ROUNDS times."""
    results: list[tuple[str, int, str]] = []
    flooding = True
    limits = httpx.Limits(max_connections=FLOOD_WORKERS + QUIET_WORKERS)
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=180, limits=limits) as client:

        async def flood(worker: int) -> None:
            for i in range(FLOOD_REQUESTS_EACH):
                results.append(await complete(client, hot, worker * 100 + i))

        async def trickle(worker: int) -> None:
            mine = quiet[worker::QUIET_WORKERS]
            rounds = 0
            while flooding or rounds < QUIET_ROUNDS:
                for i, model in enumerate(mine):
                    results.append(await complete(client, model, rounds * 100 + i))
                rounds += 1

        trickles = [asyncio.create_task(trickle(w)) for w in range(QUIET_WORKERS)]
        try:
            await asyncio.gather(*(flood(w) for w in range(FLOOD_WORKERS)))
        finally:
            flooding = False
            await asyncio.gather(*trickles)
    return results


def engine_counts(engine: str) -> dict[str, dict[str, Any]]:
    """What the engine says of each adapter it holds, by engine name (`id:<adapter id>`)."""
    listed = httpx.get(
        f"{engine}{wire.ADAPTERS_PATH}", headers={wire.INTERNAL_TOKEN_HEADER: INTERNAL_TOKEN}, timeout=30
    )
    assert listed.status_code == 200, listed.text
    return {entry["name"]: entry for entry in listed.json()["data"]}


def test_a_flooded_adapter_spreads_over_prewarmed_engines_and_quiet_ones_stay_on_one(
    platform: Platform, tmp_path: Path
) -> None:
    auth, adapters = set_up_tenant(platform, tmp_path)
    hot, quiet = adapters[0], adapters[1:]
    began = time.monotonic()
    results = asyncio.run(flood_and_trickle(platform.url, auth, hot["name"], [a["name"] for a in quiet]))
    took = time.monotonic() - began

    failed = [r for r in results if r[1] != 200]
    assert not failed, (
        f"{len(failed)} of {len(results)} requests failed, e.g. {failed[:3]}\n{platform.logs()}"
    )
    sent: dict[str, int] = {}
    for model, _, _ in results:
        sent[model] = sent.get(model, 0) + 1
    assert sent[hot["name"]] == FLOOD_WORKERS * FLOOD_REQUESTS_EACH
    assert all(sent.get(a["name"], 0) >= QUIET_ROUNDS for a in quiet), sent

    counts = [engine_counts(engine) for engine in platform.engines]

    def per_engine(adapter: dict[str, Any]) -> list[dict[str, Any]]:
        name = wire.adapter_name(adapter["id"])
        empty = {"admissions": 0, "cold_admissions": 0, "loads": 0}
        return [engine.get(name, empty) for engine in counts]

    # Every request was admitted once, on the engines the gateway sent it to (the pools are large: nothing
    # is put back for want of pages).
    hot_counts = per_engine(hot)
    served = [c for c in hot_counts if c["admissions"]]
    shown = [(c["admissions"], c["cold_admissions"], c["loads"]) for c in hot_counts]
    summary = (
        f"flooded adapter per engine (admitted, cold, loads): {shown}; {len(results)} requests, {took:.1f} s"
    )
    assert sum(c["admissions"] for c in hot_counts) == sent[hot["name"]], summary
    assert len(served) >= 2, summary
    for adapter in quiet:
        quiet_counts = per_engine(adapter)
        where = [c for c in quiet_counts if c["admissions"]]
        assert len(where) == 1, f"{adapter['name']}: {quiet_counts}"
        assert where[0]["admissions"] == sent[adapter["name"]], f"{adapter['name']}: {quiet_counts}"
        # Its first request paid its load (nobody prewarms a first placement), the others found it there.
        assert (where[0]["cold_admissions"], where[0]["loads"]) == (1, 1), (
            f"{adapter['name']}: {quiet_counts}"
        )
        assert not any(c["loads"] for c in quiet_counts if c is not where[0]), (
            f"{adapter['name']}: {quiet_counts}"
        )

    # Prewarm: the flood's first engine loaded the adapter for its first requests; every engine the set
    # grew to had loaded it once, before any of its requests came (none of them waited for a load).
    first = [c for c in hot_counts if c["cold_admissions"]]
    assert len(first) == 1 and first[0]["loads"] == 1, summary
    grown = [c for c in served if c is not first[0]]
    assert grown and all(c["loads"] == 1 and c["cold_admissions"] == 0 for c in grown), summary
    print(summary)
