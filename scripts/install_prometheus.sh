#!/usr/bin/env bash
# Installs Debian's prometheus package: the server and promtool (tests start their own server on a free
# loopback port with a temporary config and storage folder, and check rules and metrics with promtool).
set -euo pipefail
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package may start a system instance on 9090; tests never use it, and it is not ours to keep.
promtool --version | head -n 1
