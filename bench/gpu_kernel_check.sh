#!/usr/bin/env bash
# The LoRA and attention kernels on a CUDA GPU, before and after a kernel change (issue 25, item 4:
# LoRAKernelMeta and the shared @triton.jit helpers): the kernel tests run natively, then
# `python -m loraplex.bench kernels --device cuda` for this tree and for an older one, figures side by side.
#
# Two steps, because the GPU machine has neither the repository's history nor its virtual environment:
#
#   here, with git:        bash bench/gpu_kernel_check.sh prepare [OLD_COMMIT]
#                          (writes OLD_COMMIT's engine/ and bench/ to build/gpu_check/old; default: the
#                          parent of the commit that introduced engine/kernels/lora_meta.py)
#   on the GPU machine:    bash bench/gpu_kernel_check.sh
#                          (with build/gpu_check/old and build/gpu_check/wheels carried along; git-ignored)
#
# It also checks what only a GPU can: decode steps replayed from CUDA graphs give eager's tokens
# (bench/cuda_graph_check.py), and `bench step` times a Llama-2-7B-shaped decode step with graphs off and on.
#
# Needs only a python with torch and triton (pytest too for the tests; without it they are skipped with
# a note, and bench kernels still checks every kernel against the torch reference before timing it).
# The package is not installed there: a shim directory maps `loraplex.<part>` onto each tree's folders
# (pyproject's package-dir) through PYTHONPATH. Budget, by the timeouts: graphs 120 s, each
# bench step 110 s, kernel tests 120 s, engine tests 150 s, each bench kernels 120 s; the H100 run of
# 2026-11-27 (tests and bench kernels) took 2 minutes (docs/benchmarks.md, Triton kernels).
# `bench lora` is not run: it drives the engine on the CPU only (bench/lora.py: device "cpu"), so it
# never reaches these kernels.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OLD="$REPO/build/gpu_check/old"
WHEELS="$REPO/build/gpu_check/wheels"
PYTHON="${PYTHON:-python3}"
# DEVICE=cpu: a smoke test of this script itself (tiny shapes in the interpreter; no tests).
DEVICE="${DEVICE:-cuda}"

if [[ "${1:-}" == "prepare" ]]; then
    commit="${2:-$(git -C "$REPO" log --diff-filter=A --format=%H -- engine/kernels/lora_meta.py | tail -1)^}"
    rm -rf "$OLD" && mkdir -p "$OLD"
    git -C "$REPO" archive "$commit" engine bench | tar -x -C "$OLD"
    git -C "$REPO" rev-parse "$commit" > "$OLD/COMMIT"
    echo "old tree: $(cat "$OLD/COMMIT") in $OLD"
    # What the engine imports that the GPU image lacks (it has torch, triton, numpy, safetensors, pytest):
    # carried as wheels for its Python 3.12, since nothing can be fetched there.
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d "$WHEELS" google-re2 gguf
    ls "$WHEELS"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# shim DIR TREE: DIR/loraplex/{engine,bench,...} -> TREE/{engine,bench,...}; loraplex is a namespace package.
shim() {
    mkdir -p "$1/loraplex"
    for part in engine adapters bench cli wire web migrations; do
        [[ -d "$2/$part" ]] && ln -sfn "$2/$part" "$1/loraplex/$part"
    done
}
shim "$WORK/new" "$REPO"
if [[ -d "$OLD/engine" ]]; then
    # The old tree has only engine/ and bench/; anything else it imports comes from this one.
    shim "$WORK/old" "$REPO"
    shim "$WORK/old" "$OLD"
else
    echo "no old tree in $OLD (run 'bash bench/gpu_kernel_check.sh prepare' where git is): new tree only"
fi

if [[ -d "$WHEELS" ]]; then
    "$PYTHON" -m pip install -q --no-deps "$WHEELS"/*.whl || echo "could not install the carried wheels"
fi

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'
small=()
if [[ "$DEVICE" == cpu ]]; then
    export TRITON_INTERPRET=1
    small=(--small --repeats 1 --warmup 0)
elif ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "FAIL: no CUDA device visible to torch"
    exit 1
else
    unset TRITON_INTERPRET
fi
export TRITON_DEFAULT_FP_FUSION=1
status=0
# CHECKS: which parts run, in this order (default all): graphs (decode steps replayed from CUDA graphs
# against eager, bench/cuda_graph_check.py), step (`bench step` on Llama-2-7B-shaped weights, graph decode
# off and on), tests (kernel and engine tests), kernels (`bench kernels`, this tree and the old one).
CHECKS="${CHECKS:-graphs step tests kernels}"
wants() { [[ " $CHECKS " == *" $1 "* ]]; }

if wants graphs; then
    echo "== decode steps from CUDA graphs against eager steps on $DEVICE (this tree)"
    graph_args=(--dtype float16)
    [[ "$DEVICE" == cpu ]] && graph_args=(--device cpu --dtype float32 --requests 6 --batches 2)
    (cd "$WORK" && PYTHONPATH="$WORK/new" timeout 120 "$PYTHON" "$REPO/bench/cuda_graph_check.py" \
        "${graph_args[@]}" 2>&1 | grep -v Warning | tail -20)
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi

if wants step && [[ "$DEVICE" == cuda ]]; then
    for graph in off on; do
        echo "== bench step --device cuda --graph-decode $graph (Llama-2-7B shape, float16, this tree)"
        (cd "$WORK" && PYTHONPATH="$WORK/new" timeout 110 "$PYTHON" -m loraplex.bench step --device cuda \
            --graph-decode "$graph" --batches 1,32,256 --adapters 256 --steps 10 2>&1 | tail -12)
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    done
fi

wants tests && echo "== kernel tests on $DEVICE (this tree)"
if ! wants tests; then
    :
elif [[ "$DEVICE" == cpu ]]; then
    echo "SKIPPED on the CPU (the suite runs them there)"
elif "$PYTHON" -c 'import pytest' 2>/dev/null; then
    # addopts cleared: pyproject's --dist needs pytest-xdist, which a bare python lacks.
    (cd "$REPO" && PYTHONPATH="$WORK/new" timeout 120 "$PYTHON" -m pytest -q -o addopts="" -p no:cacheprovider \
        tests/engine/kernels/test_lora_kernels.py tests/engine/kernels/test_attention_kernels.py \
        tests/engine/kernels/test_dora_kernels.py tests/engine/kernels/test_fused_kernels.py \
        tests/engine/kernels/test_quant_kernels.py 2>&1 | tail -15)
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    echo "== the engine with its kernels on $DEVICE (this tree)"
    (cd "$REPO" && PYTHONPATH="$WORK/new" timeout 150 "$PYTHON" -m pytest -q -o addopts="" -p no:cacheprovider \
        tests/engine/test_engine_kernels.py tests/engine/test_fused_model_path.py tests/engine/test_batch.py \
        tests/engine/test_dora_engine_kernels.py \
        2>&1 | tail -15)
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
else
    echo "SKIPPED: pytest is not installed for $PYTHON (bench kernels below still checks results)"
fi

# bench_kernels LABEL SHIM: the LoRA and decode-attention kernels at batch 1..256, bfloat16, as JSON.
bench_kernels() {
    echo "== bench kernels: $1"
    (cd "$WORK" && PYTHONPATH="$2" timeout 120 "$PYTHON" -m loraplex.bench kernels --device "$DEVICE" --json \
        --repeats 30 --warmup 5 "${small[@]}" > "$WORK/$1.json" 2> "$WORK/$1.err")
    local rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "FAIL ($rc):" && tail -20 "$WORK/$1.err"
        return 1
    fi
}
if wants kernels; then
    bench_kernels new "$WORK/new" || status=1
    [[ -d "$WORK/old" ]] && { bench_kernels old "$WORK/old" || status=1; }
fi

"$PYTHON" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
runs = {label: json.loads((work / f"{label}.json").read_text())
        for label in ("old", "new") if (work / f"{label}.json").is_file()}
if not runs:
    sys.exit(0)
first = next(iter(runs.values()))
print(f"device: {first.get('device')}  dtype: {first.get('dtype')}")
def key(r):
    return (r["case"], r["variant"], r["batch"])
tables = {label: {key(r): r for r in doc["results"]} for label, doc in runs.items()}
print(f"{'case':<18}{'variant':<11}{'batch':>6}" + "".join(f"{l + ' us':>12}" for l in tables) + f"{'new/old':>9}")
for k in sorted(set().union(*tables.values())):
    times = [tables[l].get(k, {}).get("kernel_seconds") for l in tables]
    cells = "".join(f"{t * 1e6:>12.1f}" if t else f"{'-':>12}" for t in times)
    ratio = f"{times[-1] / times[0]:>9.3f}" if len(times) == 2 and all(times) else ""
    print(f"{k[0]:<18}{k[1]:<11}{k[2]:>6}{cells}{ratio}")
EOF

echo "== done: $([[ $status -eq 0 ]] && echo PASS || echo FAIL)"
exit $status
