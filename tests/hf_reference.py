"""transformers' own reading of the SmolLM2 GGUF, the reference the parity tests compare against, made once
per machine and kept as a Hugging Face directory.

transformers reads a GGUF through gguf's GGUFReader and its own tensor mapping, in Python, field by field:
a minute or more for this 135M model on 2 cores (the tokenizer alone takes much of it), paid by every test
module and worker that wanted the reference. The directory holds exactly what that reading produced
(`save_pretrained` of the model and the tokenizer, float32 safetensors), so loading it gives the same
reference, still independent of our own loader.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# In the user's cache beside the AOT gate's and Inductor's (tests/conftest.py): made once per machine, not
# once per checkout. Keyed by the GGUF's bytes (a new virtualenv writes the same file with a new mtime)
# and transformers' version, so a changed model or converter never reads a stale directory.
CACHE = Path.home() / ".cache" / "loraplex" / "test-reference"


def _key(gguf: Path) -> str:
    import transformers

    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return f"{gguf.stem}-{digest.hexdigest()[:16]}-transformers-{transformers.__version__}"


@contextlib.contextmanager
def _memoized_gguf() -> Iterator[None]:
    """transformers' GGUF reading with gguf's costliest pieces done once instead of per call, nothing else
    changed: the file is parsed by one GGUFReader instead of three (the config, the weights and the
    tokenizer each open their own; the vocabulary's fields alone took tens of seconds a parse),
    `get_tensor_name_map` is built once instead of once per tensor (a third of the model's reading), and
    Q4_0/Q4_1/Q8_0 blocks are decoded a tensor at a time by engine/model/gguf_dequant.py, which
    tests/engine/test_gguf_dequant.py holds to gguf's `dequantize` bit for bit. The names, the tensor
    mapping and the tokenizer conversion are still transformers' own."""
    import gguf

    from loraplex.engine.model.gguf_dequant import dequantize_blocks, fast_types

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map", "dequantize")}
    reader = functools.lru_cache(maxsize=2)(originals["GGUFReader"])

    def dequantize(data: Any, qtype: Any) -> Any:
        if getattr(qtype, "name", None) in fast_types():
            return dequantize_blocks(data, qtype.name).reshape(*data.shape[:-1], -1)
        return originals["dequantize"](data, qtype)

    patched = {
        "GGUFReader": lambda path, *args: reader(str(path), *args),
        "get_tensor_name_map": functools.lru_cache(maxsize=8)(originals["get_tensor_name_map"]),
        "dequantize": dequantize,
    }
    for name, value in patched.items():
        setattr(gguf, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(gguf, name, value)


def hf_smollm2_dir() -> Path:
    """The directory (config, float32 safetensors, tokenizer) transformers makes of the default GGUF.
    Concurrent workers wait on a lock while one of them converts; the result is renamed into place whole."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.engine.model.loader import default_model_path

    gguf = default_model_path()
    target = CACHE / _key(gguf)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            staging = Path(tempfile.mkdtemp(dir=CACHE, prefix=".staging-"))
            with _memoized_gguf():
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32
                )
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # save_pretrained refuses a model read from a GGUF ("not serializable"): its weights are plain
            # float32 by now, so they are saved as they are (save_model keeps the tied embedding once).
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            save_model(model, str(staging / "model.safetensors"))
            tokenizer.save_pretrained(staging)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)
    return target


@functools.cache
def load_hf_smollm2() -> Any:
    """transformers' model of the SmolLM2 GGUF, float32, once per process (the conftest's `hf_smollm2`)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_smollm2_dir(), dtype=torch.float32).eval()


def remembered(name: str, inputs: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`'s result (tensors, lists, numbers), computed once per machine for these `inputs` and this
    reference: transformers' outputs on a fixed model are a pure function of the inputs and the versions
    in the key, so a parity test reruns only our side of the comparison. Kept beside the converted model
    (a new converter or model makes a new directory, so stale results are never read); written whole."""
    import torch

    reference = hf_smollm2_dir()
    text = repr((name, inputs, torch.__version__, reference.name))
    path = reference / "results" / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    result = compute()
    path.parent.mkdir(exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(result, staging)
    os.replace(staging, path)
    return result
