#!/usr/bin/env bash
# The store against PyTorch 1.13's c10d TCPStore, both ways: torch's client against ddp.h's server (compared
# step by step with torch's own server), ddp.h's client against torch's server in torch's key layout, and a
# torch worker and ddp.h workers sharing torchrun's agent store.
# Skips (exit 77) only when /usr/bin/python3 cannot import torch.
set -eu
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
tl_need_python torch.distributed python3-torch
tl_cc "$BUILD/interop/store_peer" tests/interop/store_peer.c
exec "$PY" tests/interop/store_interop.py "$BUILD/interop/store_peer"
