#!/usr/bin/env bash
# Installs the system packages the build needs, only those that are missing (Debian/Ubuntu).
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/fmt/format.h ] || need+=(libfmt-dev)  # the torch-free core build (make core)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
echo "installing system packages: ${need[*]}"
if ! command -v apt-get >/dev/null; then
  echo "error: missing ${need[*]} and no apt-get here; install them with your package manager" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
