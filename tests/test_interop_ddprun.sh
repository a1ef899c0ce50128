#!/usr/bin/env bash
# ddprun vs torchrun (torch.distributed.run of the installed torch): the variables each sets for its
# workers, compared name by name and value by value, in the two launch modes ddprun has:
#   --standalone, 2 workers                       (torchrun: rank 0 serves the store, as in ddprun)
#   --nnodes 2 --node-rank 0|1, 2 workers each    (static rendezvous on a given master port)
# Compared: every variable a worker sees that the launcher's own environment does not have (values
# a shell changes on the way, such as SHLVL and _, are not the launchers'). Intended differences:
#   TORCHELASTIC_ERROR_FILE, NCCL_ASYNC_ERROR_HANDLING   torchrun only: for Python's @record and
#                                                       ProcessGroupNCCL, meaningless to a C program
#   DDP_RESTART_COUNT                                   ddprun only (= TORCHELASTIC_RESTART_COUNT)
#   TORCHELASTIC_USE_AGENT_STORE (static mode)          torchrun: True (its agent serves the store);
#                                                       ddprun: False (rank 0 serves it)
#   MASTER_ADDR (standalone)                            torchrun: localhost; ddprun: 127.0.0.1
#   MASTER_PORT, TORCHELASTIC_RUN_ID (standalone)       both a fresh free port / a random UUID
# Skips (77) when torch is not installed.
set -u
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
DDPRUN=$BUILD/ddprun
tl_need_python torch.distributed.run python3-torch
make -s BUILD="$BUILD" SAN="${SAN:-}" "$DDPRUN" || { echo "cannot build $DDPRUN"; exit 1; }
PRINT_ENV=$BUILD/progs_print_env
SANFLAGS='' tl_cc "$PRINT_ENV" tests/progs/print_env.c || { echo "cannot build tests/progs/print_env.c"; exit 1; }
tl_tmpdir test_interop_ddprun
unset OMP_NUM_THREADS # both launchers then set it to 1
# torch 1.13 takes only the underscore spellings (torch/distributed/run.py of 1.13: --nproc_per_node ...) and,
# on Python 3.11, --redirects/--tee other than 0 (torch/distributed/elastic/multiprocessing/api.py: Std.from_str("0")
# returns None there, since 3.11 no longer iterates the 0 flag Std.NONE)
TORCHRUN="$PY -m torch.distributed.run --redirects 1 --tee 1 --monitor_interval 0.2 --no_python"
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

mkdir -p "$T/base" "$T/tr_sa" "$T/dd_sa" "$T/tr_st" "$T/dd_st"
"$PRINT_ENV" "$T/base" >/dev/null || fail "print_env alone"
P=$(free_port)
# the three torchrun jobs (slow to start) run side by side
timeout 120 $TORCHRUN --standalone --nproc_per_node 2 "$PRINT_ENV" "$T/tr_sa" >"$T/tr_sa.log" 2>&1 & a=$!
for k in 0 1; do
  timeout 120 $TORCHRUN --nnodes 2 --node_rank $k --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$P" \
    "$PRINT_ENV" "$T/tr_st" >"$T/tr_st.$k.log" 2>&1 & eval "b$k=\$!"
done
wait $a || { cat "$T/tr_sa.log"; fail "torchrun --standalone failed"; }
wait "$b0" && wait "$b1" || { cat "$T"/tr_st.*.log; fail "torchrun --nnodes 2 failed"; }
"$DDPRUN" --standalone --nproc-per-node 2 "$PRINT_ENV" "$T/dd_sa" >/dev/null 2>&1 || fail "ddprun --standalone"
for k in 0 1; do
  "$DDPRUN" --nnodes 2 --node-rank $k --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$P" \
    "$PRINT_ENV" "$T/dd_st" >/dev/null 2>&1 || fail "ddprun --node-rank $k"
done

# added FILE: the names of the variables a launcher added to the base environment
keys() { grep -o '^[A-Za-z_][A-Za-z0-9_]*=' | tr -d = | sort -u; }
added() { keys <"$1" | comm -23 - <(keys <"$T/base/env.none.none"); }

# compare MODE RANK IGNORED_VALUES: torchrun's and ddprun's additions for one rank
compare() {
  local mode=$1 r=$2 ignore=" $3 " tr dd k tv dv
  tr="$T/tr_$mode/env.$r.0" dd="$T/dd_$mode/env.$r.0"
  [ -f "$tr" ] || fail "torchrun ($mode) wrote no environment for rank $r"
  [ -f "$dd" ] || fail "ddprun ($mode) wrote no environment for rank $r"
  for k in $(added "$tr"); do
    case $k in TORCHELASTIC_ERROR_FILE | NCCL_ASYNC_ERROR_HANDLING) continue ;; esac
    grep -q "^$k=" "$dd" || fail "$mode rank $r: torchrun sets $k, ddprun does not"
    tv=$(grep -m1 "^$k=" "$tr" | cut -d= -f2-) dv=$(grep -m1 "^$k=" "$dd" | cut -d= -f2-)
    [[ "$ignore" == *" $k "* ]] && { echo "  $mode rank $r: $k torchrun=$tv ddprun=$dv (differs by design)"; continue; }
    [ "$tv" = "$dv" ] || fail "$mode rank $r: $k: torchrun \"$tv\", ddprun \"$dv\""
  done
  for k in $(added "$dd"); do
    # ddp.h's own: the restart count, and the flight recorder's directory (ddprun summarizes the traces)
    case $k in DDP_RESTART_COUNT | DDP_TRACE_DIR) continue ;; esac
    grep -q "^$k=" "$tr" || fail "$mode rank $r: ddprun sets $k, torchrun does not"
  done
  echo "ok: $mode rank $r: $(added "$tr" | grep -cv -e TORCHELASTIC_ERROR_FILE -e NCCL_ASYNC) variables compared"
}
for r in 0 1; do compare sa $r "MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID"; done
for r in 0 1 2 3; do compare st $r "TORCHELASTIC_USE_AGENT_STORE"; done
# the standalone values that differ by design still have the same form
for r in 0 1; do
  for f in "$T/tr_sa/env.$r.0" "$T/dd_sa/env.$r.0"; do
    grep -Eq '^TORCHELASTIC_RUN_ID=[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$' "$f" ||
      fail "$f: TORCHELASTIC_RUN_ID is not a UUID"
    grep -q '^TORCHELASTIC_USE_AGENT_STORE=False$' "$f" || fail "$f: TORCHELASTIC_USE_AGENT_STORE is not False"
  done
done
echo "test_interop_ddprun: ddprun sets what torchrun $("$PY" -c 'import torch; print(torch.__version__)') sets"
