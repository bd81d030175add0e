#!/usr/bin/env python3
"""MTP cross-token lookahead (issue 37 item 2): `les run --mtp --mtp-lookahead N` for several N
under a memory budget, runs rotating round by round (same run, interleaved), medians.

    LES_BIN_DIR=target/ci tools/bench_mtp_lookahead.py [--model models/rand-qwen35moe-mtp.gguf]
        [--budgets 69,70] [--layers 0,1,2,4] [--store phone-1.5GBps] [--rounds 5] [--n 64]
        [--threads 2] [--governed]

Per setting: decode tokens/s, the expert hit rate, MB read and read stall per token (les run's
stats lines), and the recall / precision of the experts predicted from the drafted rows
("experts predicted from the draft's hidden states"). Without --governed every run passes
--prefetch-always (the prefetch governor would otherwise switch prefetching, and with it these
predictions, off and on while it measures).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="models/rand-qwen35moe-mtp.gguf")
ap.add_argument("--budgets", default="69,70")
ap.add_argument("--layers", default="0,1,2,4")
ap.add_argument("--store", default="phone-1.5GBps")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--n", default="64")
ap.add_argument("--threads", default="2")
ap.add_argument("--prompt", default="The capital of France is")
ap.add_argument("--governed", action="store_true")
a = ap.parse_args()
les = os.path.join(os.environ.get("LES_BIN_DIR", "target/release"), "les")

PATS = {
    "tps": r"decode \d+ tokens, ([\d.]+) tokens/s",
    "hit": r"experts: hit rate ([\d.]+)%",
    "mb": r"\| ([\d.]+) MB read/token",
    "stall": r"stall ([\d.]+) ms/token",
    "slots": r"\+ (\d+) expert slots",
    "recall": r"draft's hidden states: recall ([\d.]+)%",
    "precision": r"draft's hidden states: recall [\d.]+%, precision ([\d.]+)%",
}


def run(budget, layers):
    cmd = [les, "run", "-m", a.model, "--mtp", "--mtp-lookahead", str(layers), "--memory-budget", f"{budget}MiB",
           "--store", a.store, "-p", a.prompt, "-n", a.n, "--temp", "0", "--ignore-eos", "-t", a.threads]
    if not a.governed:
        cmd.append("--prefetch-always")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {p.stderr[-600:]}")
    out = {}
    for k, pat in PATS.items():
        m = re.search(pat, p.stderr)
        out[k] = float(m.group(1)) if m else None
    return out, p.stdout


settings = [(b, l) for b in map(int, a.budgets.split(",")) for l in map(int, a.layers.split(","))]
res = {s: [] for s in settings}
texts = {}
for r in range(a.rounds):
    order = settings[r % len(settings):] + settings[: r % len(settings)]
    if r % 2:
        order.reverse()
    for s in order:
        out, text = run(*s)
        res[s].append(out)
        texts.setdefault(s[0], set()).add(text)
        print(f"round {r} budget {s[0]} MiB lookahead {s[1]}: {out}", file=sys.stderr)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def f(x, d=2):
    return "-" if x is None else f"{x:.{d}f}"


print(f"\n{a.model}, {a.store}, {a.n} tokens greedy, -t {a.threads}, {'governed' if a.governed else '--prefetch-always'}, "
      f"{a.rounds} rounds rotating, medians\n")
print("| budget | expert slots | --mtp-lookahead | decode tok/s | vs 0 | hit rate | MB read/token | stall ms/token | draft-row recall | precision |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for b, l in settings:
    m = {k: med([o[k] for o in res[(b, l)]]) for k in PATS}
    base = med([o["tps"] for o in res[(b, settings[[s[0] for s in settings].index(b)][1])]])
    print(f"| {b} MiB | {f(m['slots'], 0)} | {l} | {f(m['tps'], 1)} | {f(m['tps'] / base if base else None)}× | {f(m['hit'], 1)}% | "
          f"{f(m['mb'])} | {f(m['stall'])} | {f(m['recall'], 1)}% | {f(m['precision'], 1)}% |")
for b, t in texts.items():
    print(f"\nbudget {b} MiB: {'the same text in every run' if len(t) == 1 else f'{len(t)} different texts'}")
