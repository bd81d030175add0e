#!/usr/bin/env python3
"""Summarise repeated `les bench ladder --stats-json` runs (tools/bench_les.sh ladder).

    tools/ladder_summary.py target/ladder-*.json

Files are named ladder-MODEL-STORE-MODE-ROUND.json. For every (model, store, mode) it prints each
rung's ratio to on-demand in every round (the ratio is taken within one run: on-demand and the
rung ran minutes apart at most), their median, and the share of decode tokens the prefetch
governor ran with prefetching on, and the governor's final estimate per round ((on − off) / off of
its MoE time per token: positive means prefetching was slower), and per round the median over
prompts of the rung's ratio on each prompt (prompt i ran in every rung within seconds; a slow
spell of the machine during one prompt moves the whole-run ratio, not this median)."""
import json, re, statistics, sys
from collections import defaultdict

runs = defaultdict(list)
for p in sys.argv[1:]:
    m = re.search(r"ladder-(.+)-(phone-4GBps|phone-1\.5GBps|disk)-(\w+)-(\d+)\.json$", p)
    if not m:
        continue
    runs[(m.group(1), m.group(2), m.group(3))].append((int(m.group(4)), json.load(open(p))))

for (model, store, mode), rs in sorted(runs.items()):
    rs.sort(key=lambda r: r[0])
    print(f"== {model} | {store} | {mode} | {len(rs)} rounds")
    names = [r["name"] for r in rs[0][1]["rungs"] if r["name"] != "resident"]
    print(f"{'rung':<22}{'×on-demand per round':<36}{'median':>8}{'pf on %':>9}{'gov est %':>11}  per-prompt median")
    for n in names:
        ratios, on, est, pm = [], [], [], []
        for _, rep in rs:
            r = next((x for x in rep["rungs"] if x["name"] == n), None)
            if r is None:
                continue
            ratios.append(r["ratio_to_on_demand"])
            if r.get("prefetch_on") is not None:
                on.append(r["prefetch_on"])
            if r.get("prompt_ratio_median") is not None:
                pm.append(r["prompt_ratio_median"])
            if (r.get("governor") or {}).get("estimate") is not None:
                est.append(r["governor"]["estimate"])
        per = " ".join(f"{x:.2f}" for x in ratios)
        share = f"{100 * statistics.mean(on):.0f}" if on else "-"
        e = " ".join(f"{100 * x:+.0f}" for x in est) if est else "-"
        p = " ".join(f"{x:.2f}" for x in pm) if pm else "-"
        print(f"{n:<22}{per:<36}{statistics.median(ratios):>8.2f}{share:>9}  {e:<9}  {p}")
