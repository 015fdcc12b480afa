#!/usr/bin/env bash
# One run of a third-party OpenAI load generator, GuideLLM, against an OpenAI-compatible server (e.g.
# `make run`'s http://127.0.0.1:8000), for comparison with `splitserve bench --backend openai`.
#
#   benchmarks/guidellm_run.sh [TARGET_URL] [MODEL_NAME] [TOKENIZER_DIR]
#
# GuideLLM needs torch; it goes into a venv of its own (.venv-guidellm, ~1.5 GB) with the project's
# CPU torch pinned first, so no CUDA build is pulled. Constant 2 req/s, 20 requests, 64 prompt and 16
# output tokens (synthetic text, tokenized with the model's own tokenizer, read offline).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-http://127.0.0.1:8000}
MODEL=${2:-demo-model-v1}
TOKENIZER=${3:-$HOME/.cache/splitserve/demo-model-v1}
VENV=.venv-guidellm
TORCH=$(grep -E '^torch==' requirements.txt)
if [ ! -x "$VENV/bin/guidellm" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH"
  "$VENV/bin/pip" install -q guidellm==0.8.1 "$TORCH"
fi
OUT=${OUT:-.bench/guidellm}
mkdir -p "$OUT"
cat > "$OUT/scenario.yaml" <<YAML
spec:
  backend: {kind: openai_http, target: "$TARGET", model: "$MODEL", request_format: /v1/completions}
  profile: {kind: constant, rate: 2}
  constraints: [{kind: max_requests, count: 20}]
  data: [{kind: synthetic_text, prompt_tokens: 64, output_tokens: 16}]
  tokenizer: {kind: hf_auto, model: "$TOKENIZER"}
YAML
HF_HUB_OFFLINE=1 "$VENV/bin/guidellm" run --scenario "$OUT/scenario.yaml" --output "kind=json,path=$OUT/guidellm.json" \
  --disable-progress
