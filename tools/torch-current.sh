#!/usr/bin/env bash
# A current-torch environment for the interop tests: a Debian sid chroot with python3-torch (torch 2.x),
# kept OUTSIDE the clone (default /var/cache/ddp-torch-current, about 2 GB; 8-15 minutes the first time,
# seconds afterwards). Needs root (debootstrap and chroot); installs debootstrap with apt-get if absent.
#
#   tools/torch-current.sh create        make the chroot (no-op when it is there and works)
#   tools/torch-current.sh status        exit 0 and print torch's version when the chroot works, else 1
#   tools/torch-current.sh root          print the chroot's directory
#   tools/torch-current.sh run CMD ARG...
#        run CMD inside the chroot, in the directory of the same path as the caller's (the clone is
#        bind-mounted at its own path, read-write), with /proc, /dev, /dev/pts and /dev/shm bind-mounted
#        for the run and unmounted after it (also on failure or a signal). The chroot shares the host's
#        network namespace, so 127.0.0.1 servers on either side reach each other. run and status mount in a
#        private mount namespace (unshare), so runs at the same time do not disturb each other.
#
# Settings: DDP_TORCH_CURRENT_DIR (cache directory), DDP_TORCH_CURRENT_MIRROR (a Debian mirror; default
# the URI of apt's configured Debian source, else http://deb.debian.org/debian), DDP_TORCH_CURRENT_SUITE
# (default sid). sid's Release file may be past its Valid-Until date: apt runs with
# Acquire::Check-Valid-Until=false.
#
# Known: Debian's torch 2.x is built without libuv, so its `torchrun` fails before any worker starts
# ("use_libuv was requested but PyTorch was built without libuv support", even with USE_LIBUV=0). The
# tests therefore play torchrun's agent themselves with TCPStore(..., use_libuv=False) (the server
# torchrun's agent creates, minus libuv); see tests/test_interop_torch_current.sh.
set -eu
DIR=${DDP_TORCH_CURRENT_DIR:-/var/cache/ddp-torch-current}
ROOT=$DIR/root
SUITE=${DDP_TORCH_CURRENT_SUITE:-sid}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo

mirror() {
  if [ -n "${DDP_TORCH_CURRENT_MIRROR:-}" ]; then echo "$DDP_TORCH_CURRENT_MIRROR"; return; fi
  local m
  m=$(grep -h -E '^(URIs:|deb ).*debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
        /etc/apt/sources.list.d/*.list 2>/dev/null | grep -v security | head -1 |
      sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//; s/[[:space:]].*$//') || true
  echo "${m:-http://deb.debian.org/debian}"
}

MOUNTED=()
unmount_all() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    $SUDO umount "${MOUNTED[$i]}" 2>/dev/null || $SUDO umount -l "${MOUNTED[$i]}" 2>/dev/null || true
  done
  MOUNTED=()
}
bind() {  # bind SRC DST-inside-root
  local dst=$ROOT$2
  mkdir -p "$dst"
  if mountpoint -q "$dst"; then return 0; fi
  $SUDO mount --bind "$1" "$dst"
  MOUNTED+=("$dst")
}
mount_all() {
  trap 'unmount_all' EXIT
  trap 'unmount_all; exit 130' INT TERM
  bind /proc /proc
  bind /dev /dev
  [ -d /dev/pts ] && bind /dev/pts /dev/pts
  [ -d /dev/shm ] && bind /dev/shm /dev/shm
  if [ -n "${1:-}" ]; then bind "$1" "$1"; fi
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
}

works() {
  [ -x "$ROOT/usr/bin/python3" ] && [ -f "$DIR/.complete" ] || return 1
  mount_all ""
  local rc=0
  $SUDO chroot "$ROOT" /usr/bin/python3 -c 'import torch, numpy; print(torch.__version__)' || rc=$?
  unmount_all
  return $rc
}

create() {
  if [ -f "$DIR/.complete" ] && works >/dev/null 2>&1; then
    echo "torch-current: $ROOT is ready (torch $(works 2>/dev/null))"
    return 0
  fi
  command -v debootstrap >/dev/null 2>&1 || {
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap ||
      { $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap; }
  }
  local m start
  m=$(mirror)
  start=$(date +%s)
  $SUDO mkdir -p "$DIR"
  rm -f "$DIR/.complete"
  if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
    $SUDO rm -rf "$ROOT"
    echo "torch-current: debootstrap $SUITE from $m into $ROOT"
    $SUDO debootstrap --variant=minbase "$SUITE" "$ROOT" "$m"
  fi
  echo 'Acquire::Check-Valid-Until "false";' | $SUDO tee "$ROOT/etc/apt/apt.conf.d/99no-valid-until" >/dev/null
  echo 'APT::Install-Recommends "false";' | $SUDO tee "$ROOT/etc/apt/apt.conf.d/99no-recommends" >/dev/null
  mount_all ""
  $SUDO chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  $SUDO chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    python3-torch python3-numpy python3-safetensors ||
    $SUDO chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-torch python3-numpy
  $SUDO chroot "$ROOT" apt-get clean
  unmount_all
  touch "$DIR/.complete"
  echo "torch-current: ready in $(( $(date +%s) - start )) s: torch $(works)"
}

cmd=${1:-}
# run and status in a private mount namespace of their own (when unshare works): their bind mounts are then
# invisible outside and vanish with the command, even on SIGKILL, and two runs at once (two clones, two
# tests) cannot unmount each other's /proc or /dev/shm. Without unshare they mount in the shared namespace.
case "$cmd" in
  run|status)
    if [ -z "${DDP_TORCH_CURRENT_NS:-}" ] && command -v unshare >/dev/null 2>&1 &&
       $SUDO unshare --mount --propagation private true 2>/dev/null; then
      exec $SUDO env DDP_TORCH_CURRENT_NS=1 unshare --mount --propagation private "$(readlink -f "$0")" "$@"
    fi
    ;;
esac
[ $# -gt 0 ] && shift
case "$cmd" in
  create) create ;;
  status) works ;;
  root) echo "$ROOT" ;;
  run)
    [ $# -gt 0 ] || { echo "usage: $0 run CMD [ARG...]" >&2; exit 2; }
    [ -f "$DIR/.complete" ] || { echo "torch-current: no chroot at $ROOT (run: $0 create)" >&2; exit 77; }
    here=$(pwd -P)
    top=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || echo "$here")
    mount_all "$top"
    rc=0
    $SUDO chroot "$ROOT" /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$here" "$@" || rc=$?
    unmount_all
    exit $rc
    ;;
  *) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
