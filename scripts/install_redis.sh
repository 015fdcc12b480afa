#!/usr/bin/env bash
# Installs redis-server from Debian's packages (tests start their own instance on a free port).
set -euo pipefail
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package may start a system instance on 6379; tests never use it, and it is not ours to keep.
redis-server --version
