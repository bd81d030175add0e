#!/usr/bin/env python3
"""Run benchmark commands interleaved (round-robin, ROUNDS rounds) and report the median of each
llama-bench-style table row (`| ... | pp512 | 453.2 ± 1.0 |`), so every command sees the same
machine conditions (these machines are shared and noisy).

  tools/bench_ab.py ROUNDS NAME=COMMAND [NAME=COMMAND ...]

Each COMMAND is one shell string, e.g.
  tools/bench_ab.py 2 "les=target/release/les bench pp-tg -m models/smolmoe-32x2.gguf -t 2" \\
                      "llama=llama-bench -o md -m models/smolmoe-32x2.gguf -t 2"
Output: one line per (name, test): median, min, max and the number of rounds, t/s.
"""
import re
import shlex
import statistics
import subprocess
import sys


def main() -> int:
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    rounds = int(sys.argv[1])
    cmds = []
    for spec in sys.argv[2:]:
        name, _, cmd = spec.partition("=")
        if not cmd:
            print(f"bad NAME=COMMAND: {spec!r}", file=sys.stderr)
            return 2
        cmds.append((name, shlex.split(cmd)))
    res = {name: {} for name, _ in cmds}
    for _ in range(rounds):
        for name, cmd in cmds:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                m = re.search(r"\|\s*((?:pp|tg)\d+)\s*\|\s*([\d.]+)", line)
                if m:
                    res[name].setdefault(m.group(1), []).append(float(m.group(2)))
    for name, _ in cmds:
        for test, v in res[name].items():
            print(f"{name:12s} {test:7s} median {statistics.median(v):8.1f}  min {min(v):8.1f}  max {max(v):8.1f}  rounds {len(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
