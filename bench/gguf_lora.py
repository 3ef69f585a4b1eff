"""A LoRA adapter as llama.cpp reads it: a GGUF file of type `adapter`, for `python -m loraplex.bench quant`.

llama.cpp's own converter (convert_lora_to_gguf.py) needs the base model's Hugging Face config and
transformers; this writer needs only the base GGUF file the adapter will be applied to, and writes what
that converter writes for a Llama:
- metadata `general.architecture` (the base file's), `general.type = adapter`, `adapter.type = lora`,
  `adapter.lora.alpha`; llama.cpp scales each pair by `adapter_scale * alpha / rank` (rank read from the
  tensor; `adapter_scale` is what `llama_set_adapters_lora` is given, 1.0 here), or by `adapter_scale`
  alone when alpha is 0;
- per target module `blk.N.<base tensor>.weight.lora_a` (A, [rank, in] slowest first, so ne = [in, rank]
  as llama.cpp requires: `ne[0]` of A equals the base tensor's) and `.lora_b` (B, [out, rank]);
- for a Llama base, the rows of q's and k's B reordered exactly as the converter reorders the base q and k
  weights (LlamaModel.permute: within each head, interleave the two rotary halves so pairs sit side by
  side; k with the key-value head count). The base weight in the file is P·W, so the adapted weight must
  be P·(W + s·B·A) = P·W + s·(P·B)·A: only B is permuted, A is not.

When every module's scale is alpha/rank for one alpha (PEFT without rslora or alpha_pattern) that alpha
is written; otherwise each B is multiplied by its own scale and alpha is written as 0, so llama.cpp's
arithmetic gives the same delta either way.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplex.adapters import BaseShape

# Our short module names -> llama.cpp's per-block base tensor names.
GGUF_TENSORS = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}
PERMUTED_ARCHITECTURES = ("llama",)  # the converter's LlamaModel.permute; qwen2 keeps HF row order


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute on the rows of `weight` ([out, ...]): per head, rows [first half;
    second half] become interleaved pairs (row i of the first half, then row i of the second)."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of rotary pairs")
    pairs = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


class BaseGGUF:
    """What the adapter file must agree with, read from the base model's GGUF file."""

    def __init__(self, path: Path):
        # The engine's own header parser: gguf's GGUFReader takes seconds over a 49k-token vocabulary.
        from loraplex.engine.model.gguf_header import parse_gguf_header
        from loraplex.engine.model.gguf_loader import _map, config_from_metadata

        self.data = _map(path)
        self.header = parse_gguf_header(self.data, str(path))
        metadata = self.header.metadata
        self.path = path
        self.architecture = str(metadata["general.architecture"])
        self.config = config_from_metadata(metadata, {t.name for t in self.header.tensors}, path)

    @property
    def shape(self) -> BaseShape:
        return self.config.lora_shape()

    def heads(self, module: str) -> int | None:
        """The head count q or k rows are permuted with on this base, None when they are not."""
        if self.architecture not in PERMUTED_ARCHITECTURES:
            return None
        return {"q": self.config.num_heads, "k": self.config.num_kv_heads}.get(module)


def lora_tensors(source: Any, base: BaseGGUF) -> tuple[float, dict[str, np.ndarray]]:
    """(alpha to write, GGUF tensor name -> float32 array) of an adapter source (engine/lora/sources.py's
    DirectorySource, engine/lora/synthetic.py's SyntheticAdapter: anything with `manifest` and `load`)."""
    modules = source.manifest.modules
    alpha = float(source.manifest.config.lora_alpha)
    folded = not all(math.isclose(m.scale, alpha / m.rank, rel_tol=1e-6) for m in modules)
    weights = source.load(torch.float32)
    tensors: dict[str, np.ndarray] = {}
    for m in modules:
        if m.module not in GGUF_TENSORS:
            raise ValueError(f"llama.cpp has no LoRA target for module {m.module!r}")
        a, b = (t.detach().to(torch.float32).numpy() for t in weights[(m.layer, m.module)])
        if folded:
            b = b * np.float32(m.scale)
        heads = base.heads(m.module)
        if heads is not None:
            b = permute_rows(b, heads)
        name = f"blk.{m.layer}.{GGUF_TENSORS[m.module]}.weight"
        tensors[f"{name}.lora_a"] = np.ascontiguousarray(a, dtype=np.float32)
        tensors[f"{name}.lora_b"] = np.ascontiguousarray(b, dtype=np.float32)
    return (0.0 if folded else alpha), tensors


def write_lora_gguf(source: Any, base: BaseGGUF, out: Path) -> Path:
    """Write `source` as a llama.cpp LoRA adapter for `base` at `out`."""
    import gguf

    alpha, tensors = lora_tensors(source, base)
    writer = gguf.GGUFWriter(str(out), base.architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def open_peft(directory: Path, base: BaseGGUF) -> Any:
    """A PEFT adapter directory, validated against the base's shapes as the engine validates it."""
    from loraplex.engine.lora.sources import DirectorySource

    return DirectorySource.open(directory, base.shape)


def main(argv: list[str] | None = None) -> int:
    from loraplex.engine.model.loader import default_model_path

    parser = argparse.ArgumentParser(description="Write a PEFT LoRA adapter as a llama.cpp GGUF adapter")
    parser.add_argument("adapter", type=Path, help="PEFT adapter directory")
    parser.add_argument("out", type=Path, help="GGUF file to write")
    parser.add_argument("--base", type=Path, default=None, help="base GGUF (default: SmolLM2's)")
    args = parser.parse_args(argv)
    base = BaseGGUF(args.base or default_model_path())
    write_lora_gguf(open_peft(args.adapter, base), base, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
