#!/usr/bin/env bash
# `make run`: serves the router inside the loopback-only sandbox (scripts/in_sandbox.sh) on unix sockets
# under .run/, and forwards 127.0.0.1:50051 (gRPC) and 127.0.0.1:8000 (OpenAI HTTP) to them from
# outside the sandbox, so that the user's other shells reach it with ordinary clients. The forwarder
# binds loopback only and stops with the router (Ctrl-C). Ports: GRPC_PORT / HTTP_PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=$PWD/.run
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/router.sock" "$RUN_DIR/http.sock"
.venv/bin/python -m splitserve.loopback_forward "127.0.0.1:${GRPC_PORT:-50051}=$RUN_DIR/router.sock" \
  "127.0.0.1:${HTTP_PORT:-8000}=$RUN_DIR/http.sock" &
FORWARDER=$!
trap 'kill "$FORWARDER" 2>/dev/null || true; wait "$FORWARDER" 2>/dev/null || true' EXIT
scripts/in_sandbox.sh .venv/bin/splitserve serve --uds "$RUN_DIR/router.sock" --http-uds "$RUN_DIR/http.sock" "$@"
