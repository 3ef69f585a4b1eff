#!/usr/bin/env bash
# Issue 25's "no slower" check on a quiet CPU: `bench offline`, `bench lora` and `bench quant` for the tree
# before the engine house (commit 5b3dbb6) and this one, interleaved in one run on the same machine.
#
# The 2-core development VM is shared and its figures move by up to 4x between runs (docs/benchmarks.md,
# "Engine house"); the GPU machine's host CPU is idle, so this runs there (or anywhere quiet), on 2 cores
# (taskset) and 2 torch threads, like the VM. Both trees use the same-shape model with random weights
# (`random:smollm2-135m`, SmolLM2-135M's shape: the GGUF file is too big to carry there); the work per
# token is the same as with the real weights.
#
#   here, with git:      bash bench/engine_house_pair.sh prepare [OLD_COMMIT]
#   on the quiet host:   bash bench/engine_house_pair.sh [PAIRS]
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OLD="$REPO/build/house_pair/old"
WHEELS="$REPO/build/house_pair/wheels"
PYTHON="${PYTHON:-python3}"
PARTS=(engine adapters bench cli wire web)

if [[ "${1:-}" == "prepare" ]]; then
    commit="${2:-5b3dbb6}"
    rm -rf "$OLD" && mkdir -p "$OLD"
    git -C "$REPO" archive "$commit" "${PARTS[@]}" | tar -x -C "$OLD"
    git -C "$REPO" rev-parse "$commit" > "$OLD/COMMIT"
    # What the engine imports beyond torch/triton/numpy/safetensors, as Python 3.12 wheels: installed there
    # only where the module is missing.
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
        gguf google-re2 fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv jinja2 \
        markupsafe tokenizers prometheus-client httpx httpcore h11 anyio sniffio uvicorn click \
        typing-extensions annotated-types typing-inspection idna certifi huggingface-hub pyyaml \
        filelock fsspec tqdm packaging requests urllib3 charset-normalizer hf-xet annotated-doc
    ls "$WHEELS" | wc -l
    exit 0
fi

PAIRS="${1:-3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
shim() {  # shim DIR TREE: DIR/loraplex/<part> -> TREE/<part> (pyproject's package-dir)
    mkdir -p "$1/loraplex"
    for part in "${PARTS[@]}"; do [[ -d "$2/$part" ]] && ln -sfn "$2/$part" "$1/loraplex/$part"; done
}
shim "$WORK/new" "$REPO"
shim "$WORK/old" "$OLD"

# Install a carried wheel only for a module this python lacks (never replace what the image has).
"$PYTHON" - "$WHEELS" "$WORK/extra" <<'PY'
import importlib.util, pathlib, subprocess, sys
wheels, target = pathlib.Path(sys.argv[1]), sys.argv[2]
names = {"google_re2": "re2", "pydantic_core": "pydantic_core", "python_dotenv": "dotenv",
         "prometheus_client": "prometheus_client", "typing_extensions": "typing_extensions",
         "huggingface_hub": "huggingface_hub", "pyyaml": "yaml", "PyYAML": "yaml", "hf_xet": "hf_xet",
         "charset_normalizer": "charset_normalizer", "typing_inspection": "typing_inspection",
         "annotated_types": "annotated_types", "pydantic_settings": "pydantic_settings", "annotated_doc": "annotated_doc"}
missing = []
for wheel in sorted(wheels.glob("*.whl")):
    dist = wheel.name.split("-")[0]
    module = names.get(dist, dist.lower())
    if importlib.util.find_spec(module) is None:
        missing.append(str(wheel))
print("installing", [pathlib.Path(m).name.split("-")[0] for m in missing])
if missing:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, *missing], check=False)
PY

echo "== machine"
lscpu | grep -E "Model name|^CPU\(s\)" | sed 's/  */ /g'
"$PYTHON" -c 'import torch; print("torch", torch.__version__)'
echo "old tree: $(cat "$OLD/COMMIT"); new tree: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo "(no git here)")"
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 CUDA_VISIBLE_DEVICES=""
MODEL=random:smollm2-135m
run() {  # run TREE NAME ARGS...: one bench for one tree on cores 0-1
    local tree="$1" name="$2"; shift 2
    echo "== $tree $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH="$WORK/$tree:$WORK/extra" taskset -c 0,1 "$PYTHON" -m loraplex.bench "$name" "$@" --model "$MODEL" 2>&1 \
        | grep -vE "Warning|warn\(" | tail -12
}
for pair in $(seq "$PAIRS"); do
    order=(old new); (( pair % 2 == 0 )) && order=(new old)
    for tree in "${order[@]}"; do
        echo "#### pair $pair: $tree"
        run "$tree" offline --skip-transformers --requests 8 --new-tokens 32 --max-prompt 128 --dtypes float32
        run "$tree" lora --parts b --requests 8 --max-tokens 16 --max-prompt 64 --repeats 1
        run "$tree" quant --skip-llama-cpp --new-tokens 16 --streams 8 --adapters 4 --repeats 1 --settings bfloat16:int8
    done
done
