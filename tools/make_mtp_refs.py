#!/usr/bin/env python3
"""llama.cpp references for LES's multi-token-prediction drafts (issue 37 item 2): writes
tests/data/mtp/refs.json.

    tools/make_mtp_refs.py [--model models/rand-qwen35moe-mtp.gguf] [-n 24]

For each prompt, runs llama.cpp's own MTP self-speculation (`llama-speculative-simple
--spec-type draft-mtp`, greedy, γ = 3, `-v`) and records, per draft round, the top-3 draft
candidates of each step with their probabilities (the `draft candidate` debug lines of
common/speculative.cpp: top-k 10, then softmax), how many drafts the target accepted and the
target's next token ("accepted A/N draft tokens, the last target token is: (T)"). The committed
sequence follows: each round commits its first A drafts and T. That llama.cpp runs these rounds at
all is the check that it loads the fixture through its MTP path (`load_block_mtp`, `graph_mtp`).

Needs llama-speculative-simple from the llama.cpp vendored in the PyPI sdist llama-cpp-python
0.3.36 (LLAMA_CPP_DIR, default /work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp, built in
$LLAMA_CPP_DIR/build; ../shared/ENVIRONMENT.md). CI does not run this: the output is committed.
"""
import argparse
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):"]
CAND = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(\s*([0-9.]+)\)")
ACC = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/rand-qwen35moe-mtp.gguf")
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    llama = os.environ.get("LLAMA_CPP_DIR", "/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp")
    exe = os.path.join(llama, "build", "bin", "llama-speculative-simple")
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True)
    version = next((l for l in (ver.stdout + ver.stderr).splitlines() if l.startswith("version:")), "")
    cases = []
    for p in PROMPTS:
        cmd = [exe, "-m", a.model, "--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-p", p,
               "-n", str(a.n), "--temp", "0", "-t", str(a.threads), "-c", "512", "-v"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True)
        log = r.stderr.decode("utf-8", "replace")
        rounds, cur = [], None
        for line in log.splitlines():
            m = CAND.search(line)
            if m:
                k, step, tok, prob = int(m[1]), int(m[2]), int(m[3]), float(m[4])
                if cur is None:
                    cur = {"steps": []}
                if k == 0:
                    cur["steps"].append([])
                    assert step == len(cur["steps"]) - 1, line
                cur["steps"][-1].append([tok, prob])
                continue
            m = ACC.search(line)
            if m:
                acc, n, last = int(m[1]), int(m[2]), int(m[3])
                rnd = cur or {"steps": []}
                # Near the end llama.cpp drafts γ steps and verifies the n that fit (n ≤ γ).
                assert n <= len(rnd["steps"]), line
                rnd.update(verified=n, accepted=acc, last=last)
                rounds.append(rnd)
                cur = None
        assert rounds and all(r_["steps"] for r_ in rounds[:-1]), "llama.cpp drafted nothing: no MTP path?"
        cases.append({"prompt": p, "text": r.stdout.decode("utf-8", "replace").strip(), "rounds": rounds})
    out = {
        "source": f"llama.cpp {version.strip()} (PyPI sdist llama-cpp-python 0.3.36), llama-speculative-simple",
        "command": "tools/make_mtp_refs.py  # runs: llama-speculative-simple -m " + a.model
                   + " --spec-type draft-mtp --spec-draft-n-max 3 -p PROMPT -n " + str(a.n)
                   + " --temp 0 -t " + str(a.threads) + " -c 512 -v",
        "model": a.model,
        "cases": cases,
    }
    path = os.path.join(ROOT, "tests/data/mtp/refs.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}: {sum(len(c['rounds']) for c in cases)} rounds")


if __name__ == "__main__":
    main()
