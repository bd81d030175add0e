#!/usr/bin/env python3
"""Image encoding, LES vs llama.cpp's `llama-mtmd-cli`, interleaved (issue 36).

  tools/bench_vision.py [--rounds 3] [--threads 2] [--les target/release/les]
                        [--llama-bin DIR] [--mmproj models/bench-minicpmv46-mmproj.gguf]

Per image and round, both tools run the same command line (`-m TEXT --mmproj P --image I -p
Describe -n 1 --temp 0 -t T`), alternating, and report:
  encode: the vision tower's time over every piece of the image (LES: "pieces encoded in X ms";
          llama-mtmd-cli: the sum of its "mtmd batch encoding done in X ms" lines);
  wall:   the whole process with one generated token (loading both files, preprocessing,
          encoding, the prompt, one token): what a user waits for the first token from a cold start.
Prints the medians and LES/llama ratios (speed: llama time / LES time) as a Markdown table.

The default vision tower is MiniCPM-V 4.6's size (SigLIP-400M, 27 layers of 1152, F16; made by
`tools/make_vlm.py mmproj --bench`, ~0.9 GB) paired with the fixture text tower
`models/rand-qwen35-vl.gguf` (its output width); the images are `tools/make_vlm.py bench-images`:
448×448 (one slice) and 1000×700 (an overview and a grid of slices).
"""
import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = (time.perf_counter() - t0) * 1000
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr[-2000:]}")
    return p.stdout, p.stderr, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--les", default="target/release/les")
    ap.add_argument("--llama-bin", default="/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")
    ap.add_argument("--model", default="models/rand-qwen35-vl.gguf")
    ap.add_argument("--mmproj", default="models/bench-minicpmv46-mmproj.gguf")
    ap.add_argument("--images", nargs="*", default=["target/bench-vision/bench_448x448.png", "target/bench-vision/bench_1000x700.png"])
    a = ap.parse_args()
    if not (ROOT / a.mmproj).exists():
        subprocess.run([sys.executable, "tools/make_vlm.py", "mmproj", "--bench", "--out", a.mmproj], cwd=ROOT, check=True)
    if not all((ROOT / i).exists() for i in a.images):
        subprocess.run([sys.executable, "tools/make_vlm.py", "bench-images"], cwd=ROOT, check=True)
    args = lambda img: ["-m", a.model, "--mmproj", a.mmproj, "--image", img, "-p", "Describe", "-n", "1", "--temp", "0", "-t", str(a.threads)]  # noqa: E731
    res = {}
    for r in range(a.rounds):
        for img in a.images:
            for tool in ("les", "llama"):
                if tool == "les":
                    out, err, wall = run([a.les, "run", *args(img)])
                    enc = float(re.search(r"pieces encoded in ([\d.]+) ms", err).group(1))
                else:
                    out, err, wall = run([f"{a.llama_bin}/llama-mtmd-cli", *args(img)])
                    enc = sum(float(x) for x in re.findall(r"mtmd batch encoding done in (\d+) ms", err))
                res.setdefault((img, tool), []).append((enc, wall, out.strip()))
                print(f"round {r} {Path(img).name} {tool}: encode {enc:.0f} ms, wall {wall:.0f} ms, text {out.strip()!r}", file=sys.stderr)
    print(f"| image | LES encode (ms) | llama.cpp encode (ms) | encode speed LES/llama | LES wall -n 1 (ms) | llama.cpp wall -n 1 (ms) | wall speed LES/llama | same text |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for img in a.images:
        le, ll = res[(img, "les")], res[(img, "llama")]
        med = lambda v, i: statistics.median(x[i] for x in v)  # noqa: E731
        same = all(x[2] == ll[0][2] for x in le + ll)
        print(f"| {Path(img).name} | {med(le, 0):.0f} | {med(ll, 0):.0f} | {med(ll, 0) / med(le, 0):.2f}× | {med(le, 1):.0f} | {med(ll, 1):.0f} | {med(ll, 1) / med(le, 1):.2f}× | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
