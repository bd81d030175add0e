#!/usr/bin/env bash
# llama.cpp decode speed on the MoE workloads (baseline for BENCHMARKS.md), 2 threads.
#
#   tools/bench_llama_moe.sh [cache|cgroup|all]
#
# cache : llama-bench -p 0 -n 32 -r $REPS (default 7) on $MODELS (default: SmolLM2 (dense), SmolMoE-32x2,
#         SmolMoE-64x4), each file read into the page cache first. Prints median and best of the
#         repetitions (the machine is shared: the best is the least disturbed run).
# cgroup: $CG_MODELS (default SmolMoE-32x2 and -64x4) inside a memory cgroup (v1) of CGROUP_MIB (default
#         400) MiB, each file evicted from the page cache first (posix_fadvise DONTNEED);
#         llama-bench -p 0 -n $CG_N (default 16) -r 1. Page
#         cache counts against the limit, so llama.cpp's mmap thrashes. Needs root and cgroup v1.
# Output: markdown on stdout; raw logs in target/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp}
BENCH=$LLAMA_CPP_DIR/build/bin/llama-bench
MIB=${CGROUP_MIB:-400}
REPS=${REPS:-7}
what=${1:-all}
mkdir -p target/bench

"$BENCH" --help >/dev/null 2>&1 || { echo "no llama-bench at $BENCH" >&2; exit 1; }
echo "llama.cpp: $("$LLAMA_CPP_DIR/build/bin/llama-completion" --version 2>&1 | grep -m1 '^version:')"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), load average: $(cut -d' ' -f1-3 /proc/loadavg)"

evict() {
  python3 -c 'import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)' "$1"
}

summ() {  # model file json
  python3 - "$@" <<'PY'
import json, statistics, sys, os
m, f, j = sys.argv[1:]
r = json.load(open(j))[0]
ts = sorted(r["samples_ts"])
allv = ", ".join(f"{x:.2f}" for x in ts)
print(f"| {m} | {os.path.getsize(f):,} | tg{r['n_gen']} x{len(ts)} | {statistics.median(ts):.2f} | {ts[-1]:.2f} | {allv} |")
PY
}

if [ "$what" = cache ] || [ "$what" = all ]; then
  echo
  echo "### page cache (file read into the page cache first), 2 threads: llama-bench -m M -t 2 -p 0 -n 32 -r $REPS -o json"
  echo
  echo "| model | file bytes | test | median t/s | best t/s | samples t/s |"
  echo "|---|---|---|---|---|---|"
  for m in ${MODELS:-SmolLM2-135M-Instruct.Q4_1 smolmoe-32x2 smolmoe-64x4}; do
    f=models/$m.gguf
    [ -f "$f" ] || { echo "| $m | missing | | | | |"; continue; }
    cat "$f" > /dev/null
    "$BENCH" -m "$f" -t 2 -p 0 -n 32 -r "$REPS" -o json 2>"target/bench/$m.cache.log" > "target/bench/$m.cache.json"
    summ "$m" "$f" "target/bench/$m.cache.json"
  done
fi

if [ "$what" = cgroup ] || [ "$what" = all ]; then
  cg=/sys/fs/cgroup/memory/les-bench-$$
  [ -d /sys/fs/cgroup/memory ] || { echo "no cgroup v1 memory controller" >&2; exit 1; }
  mkdir "$cg"
  trap 'rmdir "$cg" 2>/dev/null || true' EXIT
  echo $((MIB * 1024 * 1024)) > "$cg/memory.limit_in_bytes"
  N=${CG_N:-16}
  echo
  echo "### memory cgroup ${MIB} MiB (v1, page cache counted), file evicted first: llama-bench -m M -t 2 -p 0 -n $N -r 1 -o json"
  echo
  echo "| model | file bytes | test | t/s | - | - |"
  echo "|---|---|---|---|---|---|"
  for m in ${CG_MODELS:-smolmoe-32x2 smolmoe-64x4}; do
    f=models/$m.gguf
    [ -f "$f" ] || { echo "| $m | missing | | | | |"; continue; }
    evict "$f"
    echo 0 > "$cg/memory.max_usage_in_bytes" 2>/dev/null || true
    bash -c 'echo $$ > '"$cg"'/cgroup.procs && exec "$0" "$@"' \
      /usr/bin/time -o target/bench/$m.cgroup.time \
        -f "%e s wall, %U s user, %S s sys, %F major faults, %I fs input blocks of 512 B, max RSS %M KB" \
      "$BENCH" -m "$f" -t 2 -p 0 -n "$N" -r 1 -o json 2>target/bench/$m.cgroup.log > target/bench/$m.cgroup.json
    summ "$m" "$f" target/bench/$m.cgroup.json
    echo "  whole llama-bench run of $m (load + warmup token + $N tokens): $(cat target/bench/$m.cgroup.time);" \
         "cgroup max usage $(( $(cat "$cg/memory.max_usage_in_bytes") / 1048576 )) MiB"
  done
fi
