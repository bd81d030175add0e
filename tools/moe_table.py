#!/usr/bin/env python3
"""Expert geometry of MoE GGUF files (markdown table), for BENCHMARKS.md / fixture READMEs.

  tools/moe_table.py models/rand-*.gguf models/smolmoe-*.gguf

bytes/expert = one expert's slice of ffn_gate_exps + ffn_up_exps + ffn_down_exps (all layers have
the same geometry here); experts/token at 0% hit = n_layer * top_k * bytes/expert (what must be read
per generated token when no routed expert is cached); dense = file tensors that are not routed
experts (attention, norms, embeddings, output, routers, shared experts).
"""
import sys
from pathlib import Path

import gguf


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def main():
    print("| model | arch | layers | n_embd | n_ff (expert) | experts x top-k | expert types | "
          "bytes/expert | expert bytes (all) | dense bytes | file bytes | experts read/token at 0% hit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in sys.argv[1:]:
        r = gguf.GGUFReader(p)
        arch = r.fields["general.architecture"].contents()
        g = lambda k: r.fields[f"{arch}.{k}"].contents()  # noqa: E731
        L, D, E, K = g("block_count"), g("embedding_length"), g("expert_count"), g("expert_used_count")
        exp_total = 0
        per_layer = {}
        types = set()
        n_ff = None
        for t in r.tensors:
            if "_exps." in t.name:
                exp_total += int(t.n_bytes)
                il = int(t.name.split(".")[1])
                per_layer[il] = per_layer.get(il, 0) + int(t.n_bytes)
                types.add(t.tensor_type.name)
                if "gate_exps" in t.name:
                    n_ff = int(t.shape[1])
        per_expert = {il: b // E for il, b in per_layer.items()}
        pe = sorted(set(per_expert.values()))
        read = sum(K * b for b in per_expert.values())
        size = Path(p).stat().st_size
        dense = sum(int(t.n_bytes) for t in r.tensors) - exp_total
        pe_s = mib(pe[0]) if len(pe) == 1 else f"{pe[0] / 2**20:.2f}-{pe[-1] / 2**20:.2f} MiB"
        print(f"| {Path(p).stem} | {arch} | {L} | {D} | {n_ff} | {E} x {K} | {'/'.join(sorted(types))} | "
              f"{pe_s} ({pe[0]:,} B{'' if len(pe) == 1 else ' min'}) | {mib(exp_total)} | {mib(dense)} | "
              f"{size:,} | {mib(read)} ({read:,} B) |")


if __name__ == "__main__":
    main()
