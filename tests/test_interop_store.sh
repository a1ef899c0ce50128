#!/usr/bin/env bash
# The store against PyTorch 1.13's c10d TCPStore, both ways: torch's client against ddp.h's server (compared
# step by step with torch's own server), ddp.h's client against torch's server in torch's key layout, and a
# torch worker and ddp.h workers sharing torchrun's agent store.
# Skips (exit 77) only when /usr/bin/python3 cannot import torch.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
if ! /usr/bin/python3 -c "import torch.distributed" >/dev/null 2>&1; then
  echo "skipped: /usr/bin/python3 cannot import torch (apt-get install python3-torch)"
  exit 77
fi
case "${SAN:-}" in
  address) SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" ;;
  thread) SANFLAGS="-fsanitize=thread" ;;
  *) SANFLAGS="" ;;
esac
mkdir -p "$BUILD/interop"
# shellcheck disable=SC2086
${CC:-cc} -std=c99 -Wall -Wextra -Werror -pedantic -O2 -g -pthread -I. -Itests tests/interop/store_peer.c \
  -o "$BUILD/interop/store_peer" -lm $SANFLAGS
exec /usr/bin/python3 tests/interop/store_interop.py "$BUILD/interop/store_peer"
