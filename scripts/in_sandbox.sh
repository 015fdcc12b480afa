#!/usr/bin/env bash
# Runs a command inside a private network + PID namespace when `unshare` can make one: only loopback
# exists there, and every process left behind (stray Ray workers, TCPStores) dies with the command.
# Ray and torch's TCPStore bind all interfaces, so nothing that starts them may run outside it.
set -euo pipefail
export RAY_AUTH_MODE=disabled GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
if [ "${SPLITSERVE_IN_SANDBOX:-0}" != 1 ] && command -v unshare >/dev/null 2>&1 \
   && unshare -n -p -f --mount-proc true 2>/dev/null; then
  export SPLITSERVE_IN_SANDBOX=1
  # "$0" re-enters this script inside the namespace with the same arguments.
  # The shell stays PID 1 (reaps orphans, gets default signal handling for its child).
  exec unshare -n -p -f --mount-proc sh -c 'ip link set lo up && "$0" "$@"' "$0" "$@"
fi
exec "$@"
