#!/usr/bin/env bash
# The full ladder on SmolMoE-64x4 at ~15% of its expert bytes (issue 7) on phone-4GBps,
# phone-1.5GBps and the real disk, with the mixed-precision bundle and the SmolLM2 draft model,
# then the quality of that bundle. Needs models/smolmoe-64x4-mixed.les from
#   les pack models/smolmoe-64x4.gguf models/smolmoe-64x4-mixed.les --mixed-precision --target-bytes 2800MB --calib-tokens 128
# Budget: 570 MiB = 288 expert slots of 1.66 MB (15.0% of 3.19 GB of experts) + dense, KV and scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
LES=target/release/les
cargo build --release --bin les >&2
[ -f models/smolmoe-64x4.les ] || $LES pack models/smolmoe-64x4.gguf models/smolmoe-64x4.les
for store in ${STORES:-phone-4GBps phone-1.5GBps disk}; do
  extra=""
  [ "$store" = disk ] && extra="--direct"
  echo "== ladder smolmoe-64x4 ${BUDGET:-570MiB} $store"
  $LES bench ladder --model models/smolmoe-64x4.gguf --bundle models/smolmoe-64x4.les \
    --mixed-bundle models/smolmoe-64x4-mixed.les --draft-model models/SmolLM2-135M-Instruct.Q4_1.gguf \
    --memory-budget ${BUDGET:-570MiB} --store $store $extra -t 2 -n ${N:-24} --n-prompts ${NP:-4} \
    --stats-json target/ladder-64x4-$store.json
done
if [ -z "${NO_PPL:-}" ]; then
  echo "== quality of the mixed bundle"
  $LES eval ppl --model models/smolmoe-64x4-mixed.les --base models/smolmoe-64x4.gguf --text tests/fixtures/eval/heldout.txt
fi
