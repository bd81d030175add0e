#!/usr/bin/env python3
"""Expert layout A/B (issue 39 item 3): a bundle in the experts' own order against one packed by
co-activation, same run, alternating. Routing traces come from `les run --routes` on training
prompts; the bundles are then run on other prompts (`les run --stats-json`), per store, A B A B.
Reports decode tokens/s, reads and MB per generated token (the run's whole count over its tokens),
and the loads that came in merged reads.

    tools/bench_layout.py [--model models/smolmoe-32x2.gguf] [--budget 400MiB] [--rounds 3]
                          [--stores phone-4GBps,phone-1.5GBps,disk] [-n 48] [--threads 2]

Writes the co-activation bundle next to the model (MODEL-coact.les; delete it afterwards) and uses
MODEL.les as the index-order bundle (packed if missing). Uses $LES_BIN_DIR/les.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [
    "Explain how a steam engine works, step by step.",
    "Write a poem about autumn leaves falling in a quiet park.",
    "What are the main differences between Python and Rust for systems programming?",
    "Tell me a story about a dragon who is afraid of heights.",
]
EVAL = [
    "Describe the water cycle to a ten-year-old.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for learning a new language quickly.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models/smolmoe-32x2.gguf"))
    ap.add_argument("--budget", default="400MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stores", default="phone-4GBps,phone-1.5GBps,disk")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    les = os.path.join(ROOT, os.environ.get("LES_BIN_DIR", "target/release"), "les")
    tmp = tempfile.mkdtemp(prefix="les-layout-")
    base = a.model[:-5] if a.model.endswith(".gguf") else a.model
    index, coact = base + ".les", base + "-coact.les"
    traces = []
    for i, p in enumerate(TRAIN):
        t = os.path.join(tmp, f"train{i}.json")
        subprocess.run([les, "run", "-m", a.model, "--memory-budget", a.budget, "-t", str(a.threads), "-p", p, "-n", "64", "--temp", "0", "--ignore-eos", "--routes", t], check=True, capture_output=True)
        traces.append(t)
    if not os.path.exists(index):
        subprocess.run([les, "pack", a.model, index], check=True, capture_output=True)
    subprocess.run([les, "pack", "--order", "coactivation", "--routes", *traces, "--", a.model, coact], check=True, capture_output=True)
    rows = []
    for store in a.stores.split(","):
        for r in range(a.rounds):
            for name, b in ([("index", index), ("coactivation", coact)] if r % 2 == 0 else [("coactivation", coact), ("index", index)]):
                for k, p in enumerate(EVAL):
                    sj = os.path.join(tmp, "stats.json")
                    run = subprocess.run([les, "run", "-m", b, "--memory-budget", a.budget, "--store", store, "-t", str(a.threads), "-p", p, "-n", str(a.n), "--temp", "0", "--ignore-eos", "--stats-json", sj], capture_output=True, text=True)
                    m = re.search(r"decode (\d+) tokens, ([\d.]+) tokens/s", run.stderr)
                    if not m:
                        sys.exit(f"les run failed:\n{run.stderr[-2000:]}")
                    s = json.load(open(sj))
                    st = s.get("stream", s)
                    n = int(m.group(1))
                    rows.append({"store": store, "order": name, "round": r, "prompt": k, "tps": float(m.group(2)), "reads_per_token": st["reads"] / max(1, n),
                                 "mb_per_token": st["bytes_read"] / 1e6 / max(1, n), "merged": st.get("merged_loads", 0), "loads": st["demand_loads"] + st["prefetch_loads"]})
    print(json.dumps(rows), file=sys.stderr)
    print("| store | order | decode tok/s (median) | vs index, same round and prompt | reads per token | MB per token | loads merged |")
    print("|---|---|---|---|---|---|---|")
    for store in a.stores.split(","):
        for name in ["index", "coactivation"]:
            rs = [x for x in rows if x["store"] == store and x["order"] == name]
            ratios = []
            for x in rs:
                ref = [y for y in rows if y["store"] == store and y["order"] == "index" and y["round"] == x["round"] and y["prompt"] == x["prompt"]][0]
                ratios.append(x["tps"] / ref["tps"])
            med = lambda k: statistics.median(x[k] for x in rs)
            merged = sum(x["merged"] for x in rs) / max(1, sum(x["loads"] for x in rs))
            print(f"| {store} | {name} | {med('tps'):.1f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {med('reads_per_token'):.1f} | {med('mb_per_token'):.1f} | {100 * merged:.1f}% |")


if __name__ == "__main__":
    main()
