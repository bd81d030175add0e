#!/usr/bin/env bash
# llama.cpp decode speed on the MoE workloads (baseline for BENCHMARKS.md), 2 threads.
#
#   tools/bench_llama_moe.sh [cache|cgroup|all]
#
# cache : llama-bench -p 0 -n 32 -r 3 on SmolLM2 (dense), SmolMoE-32x2 and SmolMoE-64x4 with each file
#         read into the page cache first.
# cgroup: SmolMoE-32x2 inside a memory cgroup (v1) of CGROUP_MIB (default 400) MiB, the file evicted
#         from the page cache first (posix_fadvise DONTNEED); llama-bench -p 0 -n 16 -r 1. Page
#         cache counts against the limit, so llama.cpp's mmap thrashes. Needs root and cgroup v1.
# Output: markdown tables on stdout; raw logs in target/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp}
BENCH=$LLAMA_CPP_DIR/build/bin/llama-bench
MIB=${CGROUP_MIB:-400}
what=${1:-all}
mkdir -p target/bench

"$BENCH" --help >/dev/null 2>&1 || { echo "no llama-bench at $BENCH" >&2; exit 1; }
echo "llama.cpp: $("$LLAMA_CPP_DIR/build/bin/llama-completion" --version 2>&1 | grep -m1 '^version:')"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), load average: $(cut -d' ' -f1-3 /proc/loadavg)"

evict() {
  python3 - "$1" <<'EOF'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
EOF
}

if [ "$what" = cache ] || [ "$what" = all ]; then
  for m in SmolLM2-135M-Instruct.Q4_1 smolmoe-32x2 smolmoe-64x4; do
    f=models/$m.gguf
    [ -f "$f" ] || { echo "skip $f (missing)"; continue; }
    cat "$f" > /dev/null
    echo; echo "### page cache: $m ($(stat -c %s "$f") bytes)"
    echo '$ llama-bench -m '"$f"' -t 2 -p 0 -n 32 -r 3'
    "$BENCH" -m "$f" -t 2 -p 0 -n 32 -r 3 2>"target/bench/$m.cache.log" | tee "target/bench/$m.cache.md"
  done
fi

if [ "$what" = cgroup ] || [ "$what" = all ]; then
  f=models/smolmoe-32x2.gguf
  cg=/sys/fs/cgroup/memory/les-bench-$$
  [ -d /sys/fs/cgroup/memory ] || { echo "no cgroup v1 memory controller" >&2; exit 1; }
  mkdir "$cg"
  trap 'rmdir "$cg" 2>/dev/null || true' EXIT
  echo $((MIB * 1024 * 1024)) > "$cg/memory.limit_in_bytes"
  evict "$f"
  echo; echo "### memory cgroup ${MIB} MiB (v1, page cache counted), file evicted first: smolmoe-32x2"
  echo '$ llama-bench -m '"$f"' -t 2 -p 0 -n 16 -r 1'
  start=$(date +%s.%N)
  bash -c 'echo $$ > '"$cg"'/cgroup.procs && exec "$0" "$@"' \
    "$BENCH" -m "$f" -t 2 -p 0 -n 16 -r 1 2>target/bench/smolmoe-32x2.cgroup.log | tee target/bench/smolmoe-32x2.cgroup.md
  end=$(date +%s.%N)
  echo
  echo "wall time of the whole llama-bench run (load + warmup + 16 tokens): $(python3 -c "print(f'{$end - $start:.1f}')") s;" \
       "cgroup max usage $(( $(cat "$cg/memory.max_usage_in_bytes") / 1048576 )) MiB, failcnt $(cat "$cg/memory.failcnt")"
  grep -E "^(total_pgmajfault|pgmajfault) " "$cg/memory.stat" || true
fi
