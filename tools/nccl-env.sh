# shellcheck shell=bash
# tools/nccl-env.sh: find NCCL's header and library, for a shell script to source (gpu-check.sh and
# tests/test_nccl.sh do).
#
#   . tools/nccl-env.sh    sets NCCL_INCLUDE and NCCL_LIB (folders), or leaves them empty where none is found,
#                          and defines nccl_env_loads FILE... (below)
#
# Where it looks, in this order: NCCL_HOME (its include/ and lib/), the CUDA toolkit (CUDA_HOME, else
# /usr/local/cuda), the system's folders (/usr/include with /usr/lib/<triplet> or /usr/lib64), and last
# the nvidia-nccl-cu* wheel that PyTorch brings (site-packages/nvidia/.../nccl.h, found through $PYTHON or
# python3): a GPU machine with pip's torch often has NCCL there and nowhere else. A folder found outside
# the compiler's own search paths is added to CPATH, LIBRARY_PATH and LD_LIBRARY_PATH, so nvcc, cc and
# the programs they link find it without flags. A wheel ships libnccl.so.2 but no libnccl.so, which -lnccl
# needs: then a folder under ${TMPDIR:-/tmp} with that one link stands in for the link-time folder.

nccl_env_found() { [ -f "$1/nccl.h" ] && { [ -e "$2/libnccl.so" ] || [ -e "$2/libnccl.so.2" ]; }; }

NCCL_INCLUDE="" NCCL_LIB=""
nccl_env_cuda=${CUDA_HOME:-/usr/local/cuda}
nccl_env_py=${PYTHON:-python3}
for nccl_env_pair in "${NCCL_HOME:-/nonexistent}/include:${NCCL_HOME:-/nonexistent}/lib" \
                     "$nccl_env_cuda/include:$nccl_env_cuda/lib64" "$nccl_env_cuda/include:$nccl_env_cuda/lib" \
                     "/usr/include:/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)" \
                     "/usr/include:/usr/lib64"; do
  if nccl_env_found "${nccl_env_pair%%:*}" "${nccl_env_pair#*:}"; then
    NCCL_INCLUDE=${nccl_env_pair%%:*} NCCL_LIB=${nccl_env_pair#*:}
    break
  fi
done
if [ -z "$NCCL_LIB" ] && command -v "$nccl_env_py" >/dev/null 2>&1; then
  # the wheel: site-packages/nvidia/nccl/{include,lib} (or nvidia/cu13/... in newer layouts); a wheel
  # without the header still gives the programs built elsewhere their library
  for nccl_env_site in $("$nccl_env_py" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    nccl_env_so=$(find "$nccl_env_site/nvidia" -name libnccl.so.2 2>/dev/null | head -n 1)
    [ -n "$nccl_env_so" ] || continue
    NCCL_LIB=$(dirname "$nccl_env_so")
    [ -f "$NCCL_LIB/../include/nccl.h" ] && NCCL_INCLUDE=$(cd "$NCCL_LIB/../include" && pwd)
    break
  done
fi
if [ -n "$NCCL_LIB" ]; then
  case $NCCL_LIB in
    /usr/lib/*|/usr/lib64) ;; # the compiler's and the loader's own paths
    *)
      nccl_env_link=$NCCL_LIB
      if [ ! -e "$NCCL_LIB/libnccl.so" ]; then # a wheel: give -lnccl its unversioned name
        nccl_env_link=${TMPDIR:-/tmp}/ddp-nccl-link.$(id -u)
        mkdir -p "$nccl_env_link" && ln -sf "$NCCL_LIB/libnccl.so.2" "$nccl_env_link/libnccl.so"
      fi
      [ -n "$NCCL_INCLUDE" ] && export CPATH="$NCCL_INCLUDE${CPATH:+:$CPATH}"
      export LIBRARY_PATH="$nccl_env_link${LIBRARY_PATH:+:$LIBRARY_PATH}"
      export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
fi
unset nccl_env_cuda nccl_env_py nccl_env_pair nccl_env_site nccl_env_so nccl_env_link
unset -f nccl_env_found

# nccl_env_loads FILE...: every FILE is there and, when it is a program, the loader finds every library
# it needs (libnccl.so.2 above all) with the paths set above: a build made on another machine can run here.
nccl_env_loads() {
  local f
  for f in "$@"; do
    [ -f "$f" ] || return 1
    [ ! -x "$f" ] || ! ldd "$f" 2>/dev/null | grep -q 'not found' || return 1
  done
}
