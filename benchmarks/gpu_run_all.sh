#!/usr/bin/env bash
# Everything a GPU machine is for, in one call: environment, the CUDA tests, the GPU benchmarks.
# Each stage is time-bounded; output goes to $OUT (default ./gpu-out): all.log (the whole run),
# tests.txt (pytest's summary) and one JSON per benchmark. STAGES picks stages (comma-separated).
#   bash benchmarks/gpu_run_all.sh          # on a machine with CUDA, from the repository root
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-env,tests,decode,prefill,int8,generate,handoff,specbf16,spec,agree,specprof,spec1b}
# Not by default: int8tune (tunes the int8 kernel's plans into engine/kernels/int8_linear_plans.json).
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error GLOO_SOCKET_IFNAME=lo
export SPLITSERVE_KERNEL_DIR=${SPLITSERVE_KERNEL_DIR:-/tmp/splitserve-kernels}

stage() {  # stage NAME LIMIT_S COMMAND...: runs COMMAND if NAME is in STAGES, bounded by LIMIT_S
    local name=$1 limit=$2
    shift 2
    [[ ",$STAGES," == *",$name,"* ]] || return 0
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@"
    echo "=== $name rc=$? in $((SECONDS - start))s"
}

{
stage env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv; \
    $PYTHON -c 'import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, \
    transformers.__version__, torch.cuda.get_device_name())'"
stage tests 240 $PYTHON -m pytest -q -rfEs -p no:randomly --timeout 150 \
    tests/engine/test_triton_decode.py tests/engine/test_triton_prefill.py tests/engine/test_cuda_engine.py \
    tests/engine/test_triton_int8_linear.py tests/engine/test_triton_int4_linear.py tests/engine/test_triton_fp8_linear.py \
    tests/engine/test_cuda_speculative.py \
    tests/kvtransfer/test_transport_contract.py -k "not gloo" --junit-xml="$OUT/tests.xml"
stage decode 170 $PYTHON -m benchmarks.bench_gpu_decode --out "$OUT/decode.json"
stage prefill 120 $PYTHON -m benchmarks.bench_gpu_prefill --out "$OUT/prefill.json"
stage int8tune 300 $PYTHON -m benchmarks.tune_int8_linear --report "$OUT/int8_tune.json"
stage int8 150 $PYTHON -m benchmarks.bench_gpu_int8_linear --skip fp32 --out "$OUT/int8_linear.json"
stage generate 120 $PYTHON -m benchmarks.bench_gpu_generate --out "$OUT/generate.json"
stage handoff 100 $PYTHON -m benchmarks.bench_gpu_handoff --out "$OUT/handoff.json"
SPEC_ARGS="--device cuda --batches 1,8,64 --max-tokens 128 --text-tokens 48 --repeats 3"
stage specbf16 150 $PYTHON -m benchmarks.bench_spec $SPEC_ARGS --dtype bfloat16 --handoff-prompt 256 \
    --json "$OUT/spec_bf16.json"
stage spec 150 $PYTHON -m benchmarks.bench_spec $SPEC_ARGS --dtype float32 --handoff-prompt 256 \
    --json "$OUT/spec_fp32.json"
stage agree 120 $PYTHON -m benchmarks.bench_spec_agreement $SPEC_ARGS --dtype bfloat16 --scales 0.1 \
    --json "$OUT/spec_agreement_bf16.json"
stage specprof 90 bash -c "$PYTHON -m benchmarks.profile_spec_step --device cuda --dtype bfloat16 --batch 64 --top 30 \
    && $PYTHON -m benchmarks.profile_spec_step --device cuda --dtype bfloat16 --batch 1 --top 30"
stage spec1b 300 bash -c "$PYTHON -c 'from pathlib import Path; from benchmarks.bench_gpu_decode import build_checkpoint; \
    build_checkpoint(Path(\"/tmp/llama1b\"))' && $PYTHON -m benchmarks.bench_spec --model /tmp/llama1b --device cuda \
    --dtype bfloat16 --batches 1,8,64 --max-tokens 64 --text-tokens 48 --handoff-prompt 512 --repeats 2 \
    --json $OUT/spec_1b_bf16.json"
} 2>&1 | tee "$OUT/all.log"
