#!/usr/bin/env python3
"""The memory budget changed while `les serve` runs (issue 39 item 2): decode speed and resident
memory before a shrink, at the model's minimum, and after growing back, in rounds (full → minimum
→ full, repeated), each phase a few greedy requests with prompts never sent before (no prefix
reuse). The budget changes through `POST /les/budget`; RSS is the server's `VmRSS`
(/proc/PID/status) after each request, `expert_bytes_held` what the cache's buffers hold,
`dense_streamed` the dense bytes read from storage at each use (the minimum streams every
candidate matrix: the session frees them before its next forward).

    tools/bench_budget.py [--model models/smolmoe-32x2.gguf] [--budget 400MiB] [--rounds 3]
                          [--requests 3] [-n 48] [--threads 2] [--store disk|phone-4GBps|...]

Prints a Markdown table (median per phase over rounds; decode ratio against the full budget of
the same round) and the raw rows as JSON on stderr.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "river stone lamp garden winter copper violin harbor maple signal orbit canyon ribbon meadow lantern prism".split()


def http(addr, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{addr}{path}", data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models/smolmoe-32x2.gguf"))
    ap.add_argument("--budget", default="400MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--store", default="disk", help="disk or a device profile (les run --store)")
    ap.add_argument("--les", default=os.path.join(ROOT, os.environ.get("LES_BIN_DIR", "target/release"), "les"))
    a = ap.parse_args()
    srv = subprocess.Popen([a.les, "serve", "--model", a.model, "--memory-budget", a.budget, "--port", "0", "-t", str(a.threads), "-c", "1024", "--store", a.store], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    addr = None
    for line in srv.stderr:
        if line.startswith("les serve: listening on http://"):
            addr = line.strip().split("http://")[1]
            break
    if addr is None:
        sys.exit("les serve did not start")
    rows = []
    k = 0
    try:
        b0 = http(addr, "GET", "/les/budget")
        phases = [("full", b0["budget"]), ("minimum", b0["minimum"]), ("full again", b0["budget"])]
        for rnd in range(a.rounds):
            for name, budget in phases:
                t0 = time.perf_counter()
                b = http(addr, "POST", "/les/budget", {"memory_budget": budget})
                set_ms = (time.perf_counter() - t0) * 1000
                rss_after_set = rss_mib(srv.pid)
                for _ in range(a.requests):
                    k += 1
                    prompt = f"Request {k}: write a short story about the {WORDS[k % len(WORDS)]} and the {WORDS[(7 * k + 3) % len(WORDS)]}."
                    r = http(addr, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": a.n, "temperature": 0})
                    st = http(addr, "GET", "/les/budget")
                    rows.append({"round": rnd, "phase": name, "budget_mib": budget / 1048576, "slots": b["expert_slots"], "set_ms": set_ms, "rss_after_set_mib": rss_after_set,
                                 "tokens_per_s": r["les"]["tokens_per_s"], "rss_mib": rss_mib(srv.pid), "held_mib": st["expert_bytes_held"] / 1048576,
                                 "hit_rate": r["les"].get("hit_rate"), "dense_streamed_mib": st.get("dense_streamed", 0) / 1048576})
    finally:
        srv.terminate()
        srv.wait()
    print(json.dumps(rows), file=sys.stderr)
    print(f"| phase | budget MiB | expert slots | dense streamed MiB | decode tok/s (median) | vs full, same round | RSS MiB after the change | RSS MiB after requests (max) | cache buffers MiB | change ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, _ in phases:
        rs = [r for r in rows if r["phase"] == name]
        ratios = []
        for rnd in range(a.rounds):
            full = statistics.median(r["tokens_per_s"] for r in rows if r["round"] == rnd and r["phase"] == "full")
            mine = statistics.median(r["tokens_per_s"] for r in rs if r["round"] == rnd)
            ratios.append(mine / full)
        print(f"| {name} | {rs[0]['budget_mib']:.1f} | {rs[0]['slots']} | {max(r['dense_streamed_mib'] for r in rs):.1f} | {statistics.median(r['tokens_per_s'] for r in rs):.1f} | {min(ratios):.2f}-{max(ratios):.2f} | "
              f"{statistics.median(r['rss_after_set_mib'] for r in rs):.1f} | {max(r['rss_mib'] for r in rs):.1f} | {max(r['held_mib'] for r in rs):.1f} | {statistics.median(r['set_ms'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
