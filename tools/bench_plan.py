#!/usr/bin/env python3
"""`les plan`'s forecast against `les run` (issue 39 item 1), same run, alternating: for each
model / budget / store, each round runs `les run` (a first prompt from a file, then greedy decode
with --ignore-eos, its routing trace recorded) and then `les plan` with that trace, and the table
gives the medians and forecast / measured.

    tools/bench_plan.py [--rounds 2] [-n 48] [--threads 2] [--prompt-words 300] [CONFIG ...]

CONFIG is MODEL:BUDGET:STORE (default: the SmolMoE-32x2 and hybrid fixture set below). Uses
$LES_BIN_DIR/les (default target/release).
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = [
    "smolmoe-32x2.gguf:400MiB:disk",
    "smolmoe-32x2.gguf:400MiB:phone-4GBps",
    "smolmoe-32x2.gguf:200MiB:phone-1.5GBps",
    "rand-qwen35moe.gguf:75MiB:phone-1.5GBps",
    "rand-qwen3next.gguf:63MiB:phone-1.5GBps",
    "rand-gpt-oss.gguf:70MiB:phone-4GBps",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prompt-words", type=int, default=300)
    a = ap.parse_args()
    les = os.path.join(ROOT, os.environ.get("LES_BIN_DIR", "target/release"), "les")
    tmp = tempfile.mkdtemp(prefix="les-plan-")
    random.seed(7)
    words = "the a of lighthouse keeper sea storm bottle message island night light ship harbor wave old young found wrote read".split()
    prompt = os.path.join(tmp, "prompt.txt")
    with open(prompt, "w") as f:
        f.write(" ".join(random.choice(words) for _ in range(a.prompt_words)))
    rows = []
    for cfg in a.configs:
        model, budget, store = cfg.split(":")
        mpath = os.path.join(ROOT, "models", model)
        res = []
        for r in range(a.rounds):
            trace = os.path.join(tmp, "routes.json")
            run = subprocess.run([les, "run", "-m", mpath, "--memory-budget", budget, "--store", store, "-t", str(a.threads), "-c", str(a.ctx), "-f", prompt, "-n", str(a.n), "--temp", "0", "--ignore-eos", "--routes", trace],
                                 capture_output=True, text=True)
            m = re.search(r"prompt (\d+) tokens, ([\d.]+) tokens/s \| decode (\d+) tokens, ([\d.]+) tokens/s", run.stderr)
            if not m:
                sys.exit(f"{cfg}: les run failed:\n{run.stderr[-2000:]}")
            n_prompt = int(m.group(1))
            hit = re.search(r"hit rate ([\d.]+)%", run.stderr)
            plan = subprocess.run([les, "plan", "-m", mpath, "--memory-budget", budget, "--store", store, "-t", str(a.threads), "-c", str(a.ctx), "--routes", trace, "--prompt-tokens", str(n_prompt), "--json"], capture_output=True, text=True)
            if plan.returncode != 0:
                sys.exit(f"{cfg}: les plan failed:\n{plan.stderr[-2000:]}")
            f = json.loads(plan.stdout)
            res.append({"prompt_meas": float(m.group(2)), "decode_meas": float(m.group(4)), "prompt_fc": f["prompt_tokens_per_s"], "decode_fc": f["decode_tokens_per_s"],
                        "hit_meas": float(hit.group(1)) / 100 if hit else None, "hit_fc": f["hit_rate"], "bound": f["decode_bound"], "n_prompt": n_prompt})
        med = lambda k: statistics.median(x[k] for x in res)
        rows.append((cfg, med("decode_fc"), med("decode_meas"), med("prompt_fc"), med("prompt_meas"), med("hit_fc"), med("hit_meas"), res[-1]["bound"], res[-1]["n_prompt"]))
        print(json.dumps({"config": cfg, "rounds": res}), file=sys.stderr)
    print("| model | budget | store | decode forecast | decode measured | forecast / measured | bound | prompt forecast | prompt measured (tokens) | forecast / measured | hit rate forecast / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg, dfc, dm, pfc, pm, hfc, hm, bound, n_prompt in rows:
        model, budget, store = cfg.split(":")
        print(f"| {model} | {budget} | {store} | {dfc:.1f} | {dm:.1f} | {dfc / dm:.2f} | {bound} | {pfc:.1f} | {pm:.1f} ({n_prompt}) | {pfc / pm:.2f} | {100 * hfc:.1f}% / {100 * hm:.1f}% |")


if __name__ == "__main__":
    main()
