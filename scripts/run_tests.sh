#!/usr/bin/env bash
# Runs the pytest suite inside the loopback-only sandbox (scripts/in_sandbox.sh). Exit code 5 (no test
# collected) is turned into a failure with a clear message: the suite always has tests, so collecting
# none means something is broken.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export SPLITSERVE_TEST_TMP=${SPLITSERVE_TEST_TMP:-$(mktemp -d)}
scripts/in_sandbox.sh "$PY" -m pytest "$@"
status=$?
if [ "$status" = 5 ]; then
  echo "run_tests: pytest collected no tests (exit 5): treating as a failure" >&2
  exit 1
fi
exit "$status"
