#!/usr/bin/env bash
# A picture of a timeline file: tools/timeline.html with the file put into it, drawn by headless Chromium
# (no network; chromium-headless-shell or chromium), saved as PNG.
#     tools/timeline-png.sh TRACE.json OUT.png [HASH] [WIDTH] [HEIGHT]
# HASH is the page's view (default "pass=3": rank 0's fourth synchronised backward pass; "" for all of it).
# --dom instead of OUT.png prints the drawn page's DOM (its <title> says what was drawn; the tests read it).
set -eu
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: tools/timeline-png.sh TRACE.json OUT.png|--dom [HASH] [WIDTH] [HEIGHT]" >&2; exit 2; }
trace=$1 out=$2 hash=${3-pass=3} width=${4:-1400} height=${5:-700}
browser=""
for b in chromium-headless-shell chromium chromium-browser google-chrome; do
  if command -v "$b" >/dev/null 2>&1; then browser=$b; break; fi
done
[ -n "$browser" ] || { echo "no headless Chromium: apt-get install -y chromium-headless-shell" >&2; exit 3; }
[ -f "$trace" ] || { echo "no such file: $trace" >&2; exit 2; }
page=$(mktemp --suffix=.html)
profile=$(mktemp -d)
trap 'rm -rf "$page" "$profile"' EXIT
# the trace goes where the page's /*TRACE*/ line is ("</" escaped so that no name can end the script block)
python3 - tools/timeline.html "$trace" "$page" <<'PY'
import sys
page, trace, out = sys.argv[1:]
html = open(page, encoding="utf-8").read()
data = open(trace, encoding="utf-8").read().replace("</", "<\\/")
open(out, "w", encoding="utf-8").write(html.replace("/*TRACE*/", data, 1))
PY
args=(--headless --no-sandbox --disable-gpu --no-first-run --user-data-dir="$profile" --hide-scrollbars
      --window-size="$width,$height" --virtual-time-budget=5000)
if [ "$out" = --dom ]; then
  "$browser" "${args[@]}" --dump-dom "file://$page#$hash" 2>/dev/null
else
  "$browser" "${args[@]}" --screenshot="$out" "file://$page#$hash" >/dev/null 2>&1
  [ -s "$out" ] || { echo "$browser wrote no picture to $out" >&2; exit 1; }
  echo "wrote $out"
fi
