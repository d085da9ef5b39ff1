#!/usr/bin/env bash
# The GPU check in one go, on a machine with an NVIDIA GPU and no network:
#   (a) FlashInfer vs the torch backend on fresh random paged inputs (bf16)
#   (b) teacher-forced agreement of the torch, flashinfer and flashinfer+graphs stacks
#       and HF bf16 with HF fp32 on a random-weights Llama-3.2-1B-shaped model, then
#       the same with a planted bug (RoPE position, page index), which must fail
#   (d) `plugserve serve` (flashinfer, then torch) checked over HTTP, with the serving
#       benchmark at concurrency 1 and 64
#   (c) offline throughput of a random-weights Llama-3-8B-shaped model (bf16) at batch
#       1, 64 and 256 beside Hugging Face generate, against the HBM floor, and a
#       torch.profiler summary of plugserve's decode steps at batch 1 and 64
# It installs what the machine's Python lacks from benchmarks/gpu/wheels (fill it first
# where PyPI is reachable: bash benchmarks/gpu/fetch_wheels.sh), prints a short report
# last and exits 0 only when (a), (b) and (d) pass, each planted bug fails (b), and (c) is
# reported. results.json, report.txt and logs.txt go to $OUT if set (the device tool's
# output folder), else to benchmarks/gpu/results. Every step runs under its own limit
# and all of them under CHECK_SECONDS (default 540), so the report always comes out.
#
#     bash benchmarks/gpu/check.sh
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${OUT:-$here/results}"
work="${PLUGSERVE_GPU_WORK:-/tmp/plugserve-gpu}"
python="${PYTHON:-python3}"
export PLUGSERVE_GPU_WORK="$work" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$out" "$work"
rm -rf "$work/parts"
log="$out/logs.txt"
: >"$log"
t0=$SECONDS
deadline=$((t0 + ${CHECK_SECONDS:-540}))
say() { echo "== [$((SECONDS - t0)) s] $*" | tee -a "$log"; }
die() {
    echo "check.sh: $*" | tee -a "$log" >&2
    exit 2
}
# A step under a time limit (capped by what is left before the deadline, less 20 s for
# the report); its output goes to the screen and the log.
step() {
    local limit=$1 left=$((deadline - SECONDS - 20))
    shift
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        say "skipped for want of time: $*"
        return 124
    fi
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

# ---------------------------------------------------------------- the machine
say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log" ||
    die "no NVIDIA GPU here (nvidia-smi failed)"
"$python" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)' 2>&1 | tee -a "$log" ||
    die "$python's torch does not see a CUDA device"
# FlashInfer compiles its kernels on first use: nvcc, and ninja from the Python env.
export PATH="$("$python" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
if ! command -v nvcc >/dev/null; then
    for cuda in "${CUDA_HOME:-}" /usr/local/cuda; do
        [ -n "$cuda" ] && [ -x "$cuda/bin/nvcc" ] && export PATH="$cuda/bin:$PATH" && break
    done
fi
command -v nvcc >/dev/null || die "nvcc not found: FlashInfer compiles its kernels with it (set CUDA_HOME)"
command -v ninja >/dev/null || die "ninja not found (the pip package 'ninja' provides it)"

# ---------------------------------------------------------------- packages
say "packages"
site="$work/site"
if ! "$python" -c 'import flashinfer, tvm_ffi, pydantic, zmq, msgspec, fastapi, uvicorn' 2>/dev/null; then
    ls "$here"/wheels/flashinfer_python-*.whl >/dev/null 2>&1 ||
        die "flashinfer and plugserve's dependencies are missing and $here/wheels holds no wheels: run 'bash benchmarks/gpu/fetch_wheels.sh' where PyPI is reachable, then bring benchmarks/gpu/wheels along"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$here"/wheels/*.whl >>"$log" 2>&1 || die "installing the wheels failed (see $log)"
fi
export PYTHONPATH="$work/plugserve:$site${PYTHONPATH:+:$PYTHONPATH}"
# Installed (not run from the tree): the plugins are found through their entry points.
"$python" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
    --target "$work/plugserve" "$repo" >>"$log" 2>&1 || die "installing plugserve from $repo failed (see $log)"
"$python" -c 'from plugserve_plugins.kernels.flashinfer import FlashInferAttention as F; import flashinfer, sys; r = F.unavailable_reason(); print("flashinfer", flashinfer.__version__, r or "available"); sys.exit(1 if r else 0)' 2>&1 | tee -a "$log" ||
    die "the flashinfer backend cannot run here"
tokenizer=()
[ -f "$here/wheels/tokenizer/tokenizer.json" ] && tokenizer=(--tokenizer-from "$here/wheels/tokenizer")

# ---------------------------------------------------------------- kernels and models
say "FlashInfer JIT compile (head dims 64 and 128) in the background; random-weights models meanwhile"
timeout 420 "$python" "$here/kernel_check.py" warmup --head-dim 64 >"$work/jit64.txt" 2>&1 &
jit64=$!
timeout 420 "$python" "$here/kernel_check.py" warmup --head-dim 128 >"$work/jit128.txt" 2>&1 &
jit128=$!
for shape in 1b 8b; do
    step 300 "$python" -m plugserve.worker.random_model --shape "$shape" \
        --out "$work/models/llama-$shape" --device cuda "${tokenizer[@]}" ||
        die "writing the random $shape model failed"
done
say "models written; waiting for the compiler"
wait "$jit64"
status64=$?
wait "$jit128"
status128=$?
cat "$work/jit64.txt" "$work/jit128.txt" >>"$log"
tail -n 1 "$work/jit64.txt" "$work/jit128.txt"
[ "$status64" = 0 ] && [ "$status128" = 0 ] || die "FlashInfer JIT compilation failed (see $log)"

# ---------------------------------------------------------------- (a) (b) (d) (c)
say "(a) kernels"
step 120 "$python" "$here/kernel_check.py" check
say "(b) teacher-forced agreement, 1B"
step 180 "$python" "$here/agreement.py" --model "$work/models/llama-1b"
say "(b) planted bug: RoPE position (flashinfer with CUDA graphs); must FAIL"
step 120 "$python" "$here/agreement.py" --model "$work/models/llama-1b" \
    --stacks flashinfer+graphs --plant rope
say "(b) planted bug: page index (flashinfer eager); must FAIL"
step 120 "$python" "$here/agreement.py" --model "$work/models/llama-1b" \
    --stacks flashinfer --plant page
for attention in flashinfer torch; do
    say "(d) plugserve serve, $attention, 1B"
    step 150 "$python" "$here/serve_check.py" --model "$work/models/llama-1b" --attention "$attention"
done
say "(c) throughput, 8B"
step 60 "$python" "$here/throughput.py" bandwidth
if ! step 240 "$python" "$here/throughput.py" plugserve --model "$work/models/llama-8b" --profile; then
    say "plugserve with CUDA graphs failed: measuring it eagerly instead"
    step 240 "$python" "$here/throughput.py" plugserve --model "$work/models/llama-8b" --eager
fi
step 200 "$python" "$here/throughput.py" hf --model "$work/models/llama-8b"
say "(c) offline step of the served 1B at batch 64, the yardstick of its c=64 ITL"
step 90 "$python" "$here/throughput.py" plugserve --model "$work/models/llama-1b" \
    --batches 64 --name plugserve_1b
say "done"
"$python" "$here/report.py" "$out" 2>&1 | tee "$out/report.txt"
exit "${PIPESTATUS[0]}"
