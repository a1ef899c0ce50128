#!/usr/bin/env bash
# Issue #25's table: a job as small as a job can be (init, one barrier, two small all_reduces, destroy)
# at many ranks on this machine, ddp.h over TCP and over shared memory beside torch's gloo.
#
#   bench/scale_table.sh [--reps R] [--timeout S] [--no-gloo] [--no-build] [N ...]   (default: 16 32 64, R = 3)
#
# For each N and each repetition, interleaved (so that load changes hit every contender alike):
#   tcp   DDP_TRANSPORT=tcp  build/ddprun --standalone --nproc-per-node N build/scale_probe
#   shm   DDP_TRANSPORT=auto build/ddprun --standalone --nproc-per-node N build/scale_probe
#   gloo                     build/ddprun --standalone --nproc-per-node N /usr/bin/python3 bench/peers/gloo_scale.py
# (ddprun gives each worker torchrun's variables, which torch's env:// reads.) Every rank of either probe
# prints "scale_probe backend=B rank=R world=N init_s=X run_s=Y t_start=T0 t_init=T1" and checks its
# all_reduces against serial math. A run counts when ddprun exits 0 and all N ranks printed their line;
# its figures are the slowest rank's init_s and run_s; the rendezvous after the last arrival, the latest
# t_init less the latest t_start (the slowest rank's init_s also holds the spread of the ranks'
# start-up, which for gloo is torch's import: seconds at 16 ranks on 2 cores); and the wall time of the
# whole ddprun command (process start-up, and torch's import for gloo, included). Each cell is the
# median over the runs that counted; "-" when none did (or gloo was skipped), "(k failed)" after it
# when some did not.
#
# Everything runs under `nice -n 19` and each run under `timeout S` (default 300 s, then SIGKILL 10 s
# later; ddprun forwards the signal and leaves no orphans). Gloo is skipped, saying so, when
# N x GLOO_MIB_PER_RANK (default 250, torch 1.13's resident size per rank: 227 MiB measured after
# init at 4 ranks, of which 114 MiB are libtorch's pages shared by all ranks and 112 MiB the rank's
# own, so GLOO_MIB_PER_RANK=120 is the rank's real cost) exceeds 60% of MemAvailable, when
# /usr/bin/python3 has no torch, or with --no-gloo. Each run's output is kept in LOGDIR (default $BUILD/scale_table), named
# N<n>_<contender>_<rep>.log; a failed run's last lines are printed.
#
# Another revision's ddp.h: build its ddprun and scale_probe into a folder and give it as BUILD with
# --no-build (which runs the programs there as they are, instead of making them from this checkout);
# bench/README.md's #25 section shows how.
# Environment: BUILD (build), PEERS (bench/peers), PYTHON (/usr/bin/python3), GLOO_MIB_PER_RANK (250),
# LOGDIR; SCALE_PROBE: the ddp.h probe's command instead of $BUILD/scale_probe (the smoke test,
# tests/test_scale_table.sh, gives it failing and hanging commands).
# Exit status: 0 when every run that was started counted, 1 otherwise, 2 for a usage error.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PEERS=${PEERS:-bench/peers}
PYTHON=${PYTHON:-/usr/bin/python3}
GLOO_MIB_PER_RANK=${GLOO_MIB_PER_RANK:-250}
LOGDIR=${LOGDIR:-$BUILD/scale_table}
reps=3 limit=300 gloo=1 build=1 sizes=()
usage() { sed -n '5p' "$0" | sed 's/^# *//'; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --reps) reps=${2:-}; shift 2 ;;
    --timeout) limit=${2:-}; shift 2 ;;
    --no-gloo) gloo=0; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) usage ;;
    -*) echo "scale_table.sh: unknown flag $1"; usage ;;
    *) sizes+=("$1"); shift ;;
  esac
done
[ ${#sizes[@]} -gt 0 ] || sizes=(16 32 64)
for v in "$reps" "$limit" "${sizes[@]}"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "scale_table.sh: '$v' is not a positive whole number"; usage; }
done

if [ $build = 1 ]; then
  nice -n 19 make -s "$BUILD/ddprun" "$BUILD/scale_probe" || { echo "scale_table.sh: cannot build $BUILD/ddprun and $BUILD/scale_probe"; exit 1; }
fi
[ -x "$BUILD/ddprun" ] || { echo "scale_table.sh: no $BUILD/ddprun (leave out --no-build, or build it there)"; exit 1; }
probe=${SCALE_PROBE:-$BUILD/scale_probe}
mkdir -p "$LOGDIR"
if [ $gloo = 1 ]; then
  if [ ! -f "$PEERS/gloo_scale.py" ]; then gloo=0; echo "gloo not run: $PEERS/gloo_scale.py is missing"
  elif ! "$PYTHON" -c "import torch.distributed" >/dev/null 2>&1; then gloo=0; echo "gloo not run: $PYTHON has no torch.distributed"
  fi
fi

# the median of the numbers on stdin, to 3 significant digits or so (0.004, 0.47, 3.81, 27.4, 180)
median() {
  sort -g | awk '{ v[NR] = $1 } END {
    if (!NR) exit
    m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf(m >= 100 ? "%.0f" : m >= 10 ? "%.1f" : m >= 1 ? "%.2f" : "%.3f", m)
  }'
}
mem_available_mib() { awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo; }

# run_once N CONTENDER REP: one ddprun; prints "init run rendezvous wall" (seconds) when the run counted,
# nothing when it did not (after showing why).
run_once() {
  local n=$1 who=$2 rep=$3 log start end rc
  log="$LOGDIR/N${n}_${who}_${rep}.log"
  start=$(date +%s%N)
  case $who in
    tcp) DDP_TRANSPORT=tcp nice -n 19 timeout --kill-after=10 "$limit" "$BUILD/ddprun" --standalone --nproc-per-node "$n" $probe ;;
    shm) DDP_TRANSPORT=auto nice -n 19 timeout --kill-after=10 "$limit" "$BUILD/ddprun" --standalone --nproc-per-node "$n" $probe ;;
    gloo) nice -n 19 timeout --kill-after=10 "$limit" "$BUILD/ddprun" --standalone --nproc-per-node "$n" "$PYTHON" "$PEERS/gloo_scale.py" ;;
  esac >"$log" 2>&1 </dev/null
  rc=$?
  end=$(date +%s%N)
  # the slowest rank's figures, if all n ranks of world n printed theirs
  local figures
  figures=$(awk -v n="$n" '
    /^scale_probe backend=/ {
      r = -1; w = -1; i = -1; t = -1; t0 = -1; t1 = -1
      for (k = 3; k <= NF; k++) {
        split($k, kv, "=")
        if (kv[1] == "rank") r = kv[2]; else if (kv[1] == "world") w = kv[2]
        else if (kv[1] == "init_s") i = kv[2] + 0; else if (kv[1] == "run_s") t = kv[2] + 0
        else if (kv[1] == "t_start") t0 = kv[2] + 0; else if (kv[1] == "t_init") t1 = kv[2] + 0
      }
      if (w == n && r >= 0 && !(r in seen) && i >= 0 && t >= 0 && t0 > 0 && t1 > 0) {
        seen[r] = 1; count++
        if (i > mi) mi = i; if (t > mt) mt = t; if (t0 > last_in) last_in = t0; if (t1 > last_out) last_out = t1
      }
    }
    END { if (count == n) printf "%.4f %.4f %.4f\n", mi, mt, last_out - last_in; else print "ranks " count + 0 }' "$log")
  if [ $rc -eq 0 ] && [[ $figures != ranks* ]]; then
    echo "$figures $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.4f", (b - a) / 1e9 }')"
    return
  fi
  local why="exit $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after $limit s (exit $rc)"
  echo "N=$n $who run $rep failed: $why, ${figures#ranks } of $n ranks reported; last lines of $log:" >&2
  tail -n 5 "$log" | sed 's/^/    /' >&2
}

echo "scale_table: programs in $BUILD$([ $build = 1 ] && echo ", made from this checkout" || echo " as they were (--no-build)"); checkout HEAD $(git rev-parse --short HEAD 2>/dev/null), ddp.h as of $(git log -1 --format=%h -- ddp.h 2>/dev/null)$(git diff --quiet HEAD -- ddp.h 2>/dev/null || echo ' (modified since)'), $(nproc) CPUs, $(mem_available_mib) MiB available, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
failed=0
rows=""
for n in "${sizes[@]}"; do
  declare -A cell=()
  run_gloo=$gloo
  if [ $run_gloo = 1 ]; then
    avail=$(mem_available_mib)
    if [ $((n * GLOO_MIB_PER_RANK)) -gt $((avail * 60 / 100)) ]; then
      run_gloo=0
      echo "gloo skipped at N=$n: $n x $GLOO_MIB_PER_RANK MiB > 60% of MemAvailable ($avail MiB); GLOO_MIB_PER_RANK sets the per-rank figure"
    fi
  fi
  contenders="tcp shm"; [ $run_gloo = 1 ] && contenders="tcp shm gloo"
  for who in $contenders; do cell[$who.init]="" cell[$who.run]="" cell[$who.rdzv]="" cell[$who.wall]="" cell[$who.failed]=0; done
  for rep in $(seq 1 "$reps"); do
    for who in $contenders; do
      out=$(run_once "$n" "$who" "$rep")
      if [ -z "$out" ]; then cell[$who.failed]=$((cell[$who.failed] + 1)); failed=1; continue; fi
      read -r i t r w <<<"$out"
      echo "N=$n $who run $rep: slowest init $i s, slowest run $t s, rendezvous after the last arrival $r s, ddprun wall $w s"
      cell[$who.init]+="$i"$'\n' cell[$who.run]+="$t"$'\n' cell[$who.rdzv]+="$r"$'\n' cell[$who.wall]+="$w"$'\n'
    done
  done
  # show WHO KIND: the median with its unit, "-" when no run counted, "(k failed)" when some did not
  show() {
    local v=""
    [ -n "${cell[$1.$2]+set}" ] && v=$(printf '%s' "${cell[$1.$2]}" | median)
    if [ -z "$v" ]; then printf -- "-"; else printf "%s s" "$v"; fi
    [ -n "${cell[$1.failed]+set}" ] && [ "${cell[$1.failed]}" -gt 0 ] && printf " (%s failed)" "${cell[$1.failed]}"
    return 0
  }
  rows+="| $n | $(show tcp init) | $(show shm init) | $(show tcp run) | $(show shm run) | $(show gloo init) | $(show gloo run) | $(show tcp rdzv) / $(show shm rdzv) / $(show gloo rdzv) | $(show tcp wall) / $(show shm wall) / $(show gloo wall) |"$'\n'
  unset cell
done
echo
echo "Medians of $reps runs of the slowest rank's time (init: in ddp_init / init_process_group; whole run: from"
echo "before init to after destroy); after the last arrival: from the last rank's entry into init to the last"
echo "rank's exit; ddprun wall: the whole launch, process start-up and imports included."
echo
echo "| ranks | init, TCP | init, shm | whole run, TCP | whole run, shm | gloo init | gloo whole run | init after the last arrival: TCP / shm / gloo | ddprun wall: TCP / shm / gloo |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s' "$rows"
exit $failed
