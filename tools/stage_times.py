#!/usr/bin/env python3
"""Timing for `./build.sh test` (issue 35).

  stage_times.py pipe LOG      copy stdin to stdout; each cargo test binary's wall time (from
                               cargo's "Running ..." line to the next one, or to the end) is
                               appended to LOG as "test <name>\t<seconds>"
  stage_times.py table LOG     print LOG as a table with a total (stages only; the per-binary
                               rows are indented under the stage that ran them)
"""
import re
import sys
import time


def pipe(log):
    running = re.compile(r"^\s*(?:Running (?:unittests )?|(Doc-tests) )(\S+)")
    cur, t0 = None, None
    rows = []
    for line in sys.stdin:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = running.match(line)
        if m:
            now = time.monotonic()
            if cur is not None:
                rows.append((cur, now - t0))
            cur, t0 = " ".join(g for g in m.groups() if g), now
    if cur is not None:
        rows.append((cur, time.monotonic() - t0))
    with open(log, "a") as f:
        for name, dt in rows:
            f.write(f"  test {name}\t{dt:.1f}\n")


def table(log):
    total = 0.0
    lines = []
    for raw in open(log):
        name, dt = raw.rstrip("\n").rsplit("\t", 1)
        dt = float(dt)
        if not name.startswith("  "):
            total += dt
        lines.append((name, dt))
    w = max([len(n) for n, _ in lines] + [5])
    print(f"{'stage'.ljust(w)}  seconds")
    for n, dt in lines:
        print(f"{n.ljust(w)}  {dt:7.1f}")
    print(f"{'total'.ljust(w)}  {total:7.1f}  ({total / 60:.1f} min)")


if __name__ == "__main__":
    {"pipe": pipe, "table": table}[sys.argv[1]](sys.argv[2])
