"""transformers' own reading of the SmolLM2 GGUF, the reference the parity tests compare against, made once
per machine and kept as a Hugging Face directory.

transformers reads a GGUF through gguf's GGUFReader and its own tensor mapping, in Python, field by field:
a minute or more for this 135M model on 2 cores (the tokenizer alone takes much of it), paid by every test
module and worker that wanted the reference. The directory holds exactly what that reading produced
(`save_pretrained` of the model and the tokenizer, float32 safetensors), so loading it gives the same
reference, still independent of our own loader.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "build" / "test-cache"


def _key(gguf: Path) -> str:
    import transformers

    stat = gguf.stat()
    return f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-transformers-{transformers.__version__}"


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
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            # save_pretrained refuses a model read from a GGUF ("not serializable"): its weights are plain
            # float32 by now, so they are saved as they are (save_model keeps the tied embedding once).
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            save_model(model, str(staging / "model.safetensors"))
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)
    return target
