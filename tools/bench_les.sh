#!/usr/bin/env bash
# LES benchmarks recorded in BENCHMARKS.md. Run on a quiet machine; every figure in one run.
#   tools/bench_les.sh decode    LES vs llama.cpp decode on SmolLM2-135M (2 threads, same session)
#   tools/bench_les.sh ladder    the streaming ladder for SmolMoE-32x2 / 64x4 at 400 MiB, ROUNDS rounds
#                                with the prefetch governor and with --prefetch-always (median ratios)
#   tools/bench_les.sh pptg      `les bench pp-tg` and llama-bench (pp512, tg128) interleaved, REPS
#                                rounds (median), at 1 and 2 threads, on SmolLM2 and resident
#                                SmolMoE-32x2 / 64x4 (tools/build_models.sh all); BASE=older les binary
# llama.cpp: LLAMA_CPP_DIR (default: the llama-cpp-python 0.3.36 vendored build, see ../shared/ENVIRONMENT.md).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp}
LES=target/release/les
cargo build --release --bin les >&2
what=${1:-all}
if [ "$what" = decode ] || [ "$what" = all ]; then
  echo "== decode, SmolLM2-135M Q4_1, 2 threads"
  $LES bench decode --model models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -n 128 -r 3
  if [ -x "$LLAMA_CPP_DIR/build/bin/llama-bench" ]; then
    "$LLAMA_CPP_DIR/build/bin/llama-bench" -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 0 -n 128 -r 3 -o md
  fi
fi
if [ "$what" = pptg ] || [ "$what" = all ]; then
  # Interleaved round by round (tools/bench_ab.py); BASE=path/to/an/older/les adds a third column.
  LB="$LLAMA_CPP_DIR/build/bin/llama-bench"
  for t in 1 2; do
    for m in ${PPTG_MODELS:-SmolLM2-135M-Instruct.Q4_1 smolmoe-32x2 smolmoe-64x4}; do
      echo "== $m, $t threads, pp512 + tg128, ${REPS:-2} rounds of -r 3"
      args="-m models/$m.gguf -t $t -p 512 -n 128 -r 3"
      cmds=("les=$LES bench pp-tg $args")
      [ -n "${BASE:-}" ] && cmds+=("base=$BASE bench pp-tg $args")
      [ -x "$LB" ] && cmds+=("llama.cpp=$LB -o md $args")
      python3 tools/bench_ab.py "${REPS:-2}" "${cmds[@]}"
    done
  done
fi
if [ "$what" = ladder ] || [ "$what" = all ]; then
  # ROUNDS rounds; each runs the ladder with the prefetch governor (default) and with
  # --prefetch-always, one after the other; tools/ladder_summary.py gives the median ratios.
  # RESIDENT=1 adds the resident rung (the oracle bound) to every run.
  for m in ${MODELS:-smolmoe-32x2 smolmoe-64x4}; do
    rm -f target/ladder-$m-*.json
    for store in ${STORES:-phone-4GBps phone-1.5GBps disk}; do
      extra=""
      [ "$store" = disk ] && extra="--direct"
      [ "${RESIDENT:-0}" = 1 ] || extra="$extra --no-resident"
      for r in $(seq 1 ${ROUNDS:-1}); do
        for mode in governed always; do
          flag=""
          [ $mode = always ] && flag="--prefetch-always"
          echo "== ladder $m 400MiB $store $mode round $r"
          $LES bench ladder --model models/$m.gguf --memory-budget 400MiB --store $store $extra $flag -t ${THREADS:-2} \
            -n ${N:-24} --n-prompts ${NP:-4} --stats-json target/ladder-$m-$store-$mode-$r.json
        done
      done
    done
  done
  python3 tools/ladder_summary.py target/ladder-*.json
fi
