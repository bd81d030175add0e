#!/usr/bin/env bash
# The seed's scale (issue 18): a qwen35moe with Qwen3.5/3.6-35B-A3B's exact hyper-parameters and
# tensor shapes (random weights, Q4_K_M-like types, about 21 GB) decoded under a 3 GiB budget.
#
#   tools/bench_full.sh [MODEL]      (default models/qwen35moe-35b-a3b-rand.gguf)
#
# Builds the default model when missing (`tools/make_moe.py full`, about 2 minutes; never
# committed). gpt-oss-20b's shapes (issue 19, 11.8 GB): `tools/make_moe.py full --arch gpt-oss-20b
# --out models/gpt-oss-20b-rand.gguf`, then pass that file and its BUDGET.
# Then, interleaved over $ROUNDS rounds (default 2), each run after evicting the file from the
# page cache:
#   LES        les run --memory-budget $BUDGET -n $N on --store disk --direct, phone-4GBps and
#              phone-1.5GBps (les's own stats line: tokens/s, hit rate, MB read per token, stall;
#              peak RSS from /usr/bin/time)
#   llama.cpp  llama-bench -p 0 -n $LLAMA_N -r 1 -lm mmap --repack 0 inside a memory cgroup (v1)
#              of $BUDGET, page cache counted (mmap, as a phone without swap would run it; the CPU
#              backend's default repacking copies the Q4_K weights into anonymous memory, which
#              the cgroup kills at 3 GiB)
# Env: BUDGET (3GiB; the cgroup gets the same bytes), N (16), LLAMA_N (4), ROUNDS (2), THREADS (2),
# LLAMA_CPP_DIR (as tools/make_refs.sh). Output: markdown on stdout; logs in target/bench/full/.
# Needs root for the cgroup. Delete the model afterwards if the disk is short (21 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
M=${1:-models/qwen35moe-35b-a3b-rand.gguf}
BUDGET=${BUDGET:-3GiB}
N=${N:-16}
LLAMA_N=${LLAMA_N:-4}
ROUNDS=${ROUNDS:-2}
T=${THREADS:-2}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp}
BENCH=$LLAMA_CPP_DIR/build/bin/llama-bench
LES=target/release/les
OUT=target/bench/full
mkdir -p "$OUT"
[ -f "$M" ] || python3 tools/make_moe.py full --out "$M"
[ -x "$LES" ] || cargo build --release --bin les
bytes=$(python3 -c "import re,sys; s=sys.argv[1]; m=re.fullmatch(r'([0-9.]+)\s*(GiB|MiB)', s); print(int(float(m[1]) * (1<<30 if m[2]=='GiB' else 1<<20)))" "$BUDGET")

evict() {
  python3 -c 'import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)' "$1"
}

echo "model: $M ($(stat -c %s "$M") bytes), budget $BUDGET, $T threads, commit $(git rev-parse --short HEAD), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), flags: $(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_vnni|avx_vnni|fma|f16c)$' | tr '\n' ' ')"
echo "llama.cpp: $("$LLAMA_CPP_DIR/build/bin/llama-completion" --version 2>&1 | grep -m1 '^version:' || echo missing)"
echo
echo "| round | engine | store | decode t/s | prompt t/s | hit rate | MB read/token | stall ms/token | peak RSS MiB |"
echo "|---|---|---|---|---|---|---|---|---|"

les_run() {  # round store [--direct]
  local r=$1 store=$2; shift 2
  local log=$OUT/les.$store.$r.log
  evict "$M"
  /usr/bin/time -o "$OUT/les.$store.$r.time" -f "%M" \
    "$LES" run -m "$M" --memory-budget "$BUDGET" -c 512 -t "$T" --store "$store" "$@" \
      -p "The capital of France is" -n "$N" --temp 0 >/dev/null 2>"$log"
  python3 - "$r" "$store$([ $# -gt 0 ] && echo ' (O_DIRECT)')" "$log" "$OUT/les.$store.$r.time" <<'PY'
import re, sys
r, store, log, tf = sys.argv[1:]
s = open(log).read()
g = lambda p: (re.search(p, s) or [None, "?"])[1]
rss = int(open(tf).read().split()[-1]) / 1024
mb = g(r"experts: .*?([0-9.]+) MB read/token")
dense = re.search(r"dense weights read from storage: ([0-9.]+) MB read/token", s)
if dense and mb != "?":  # dense matrices the budget cannot hold, read each token too
    mb = f"{float(mb) + float(dense[1]):.0f} ({mb} experts + {dense[1]} dense)"
cells = [g(r"decode \d+ tokens, ([0-9.]+) tokens/s"), g(r"prompt \d+ tokens, ([0-9.]+) tokens/s"),
         g(r"hit rate ([0-9.]+%)"), mb, g(r"stall ([0-9.]+) ms/token")]
print(f"| {r} | LES | {store} | " + " | ".join(cells) + f" | {rss:.0f} |")
PY
}

llama_run() {  # round
  local r=$1
  [ -x "$BENCH" ] || { echo "| $r | llama.cpp | (no llama-bench at $BENCH) | | | | | | |"; return; }
  [ -d /sys/fs/cgroup/memory ] || { echo "| $r | llama.cpp | (no cgroup v1 memory controller) | | | | | | |"; return; }
  local cg=/sys/fs/cgroup/memory/les-full-$$
  mkdir -p "$cg"
  echo "$bytes" > "$cg/memory.limit_in_bytes"
  evict "$M"
  bash -c 'echo $$ > '"$cg"'/cgroup.procs && exec "$0" "$@"' \
    /usr/bin/time -o "$OUT/llama.$r.time" -f "%M" \
    "$BENCH" -m "$M" -t "$T" -p 0 -n "$LLAMA_N" -r 1 -lm mmap --repack 0 -o json 2>"$OUT/llama.$r.log" >"$OUT/llama.$r.json" || true
  local peak=$(( $(cat "$cg/memory.max_usage_in_bytes") / 1048576 ))
  rmdir "$cg" 2>/dev/null || true
  python3 - "$r" "$OUT/llama.$r.json" "$OUT/llama.$r.time" "$peak" <<'PY'
import json, sys
r, jf, tf, peak = sys.argv[1:]
try:
    ts = json.load(open(jf))[0]["avg_ts"]
    t = f"{ts:.3f}"
except Exception as e:
    t = f"failed ({type(e).__name__})"
rss = int(open(tf).read().split()[-1]) / 1024
print(f"| {r} | llama.cpp (mmap, {peak} MiB cgroup peak) | disk | {t} | | | | | {rss:.0f} |")
PY
}

for r in $(seq 1 "$ROUNDS"); do
  les_run "$r" disk --direct
  les_run "$r" phone-4GBps
  les_run "$r" phone-1.5GBps
  llama_run "$r"
done
