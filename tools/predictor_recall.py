#!/usr/bin/env python3
"""Offline recall of lookahead predictors on SmolMoE-32x2 (issue 4 analysis, session 5).

  LES_DEBUG_DUMP_DIR=/tmp/dd target/release/les run --model models/smolmoe-32x2.gguf \
      --prompt "Once upon a time, in a small village by the sea," -n 40 --temp 0
  python3 tools/predictor_recall.py

For every decode step and layer, routes layer l+1 (and l+2) from hidden states LES dumped while
running (ffn_inp, l_out, ffn_moe_topk per layer) with the model's own routers and ffn_norm
weights (read with the gguf package), and prints recall of the true top-k at several
candidate counts. `P0` (the true input) must give 100%: a check that dumps and weights align.
"""
import numpy as np, gguf, os
r=gguf.GGUFReader('models/smolmoe-32x2.gguf')
T={t.name:t for t in r.tensors}
L=30;E=32;K=2;D=576
R=[np.array(T[f'blk.{l}.ffn_gate_inp.weight'].data,dtype=np.float32).reshape(E,D) for l in range(L)]
W=[np.array(T[f'blk.{l}.ffn_norm.weight'].data,dtype=np.float32) for l in range(L)]
def ld(step,name,l): return np.fromfile(f'/tmp/dd/{step}/{name}-{l}.f32',dtype=np.float32)
def rms(x): return x/np.sqrt((x*x).mean()+1e-5)
steps=sorted(int(s) for s in os.listdir('/tmp/dd'))[1:]  # decode steps (step 0 = prompt)
res={}
def add(k,hit,n): a=res.setdefault(k,[0,0]); a[0]+=hit; a[1]+=n
for s in steps:
    for l in range(L-1):
        truth=set(int(v) for v in ld(s,'ffn_moe_topk',l+1))
        fn=ld(s,'ffn_norm',l); fi=ld(s,'ffn_inp',l); lo=ld(s,'l_out',l)
        # next token's own attention output unknown; candidates:
        preds={
          'P1 ffn_norm_l reweighted': rms(fi)*W[l+1],
          'P2 l_out_l (after FFN l)': rms(lo)*W[l+1],
          'P0 truth input (ffn_inp l+1)': rms(ld(s,'ffn_inp',l+1))*W[l+1],
        }
        for name,h in preds.items():
            lg=R[l+1]@h; order=np.argsort(-lg)
            for kk in (2,3,4,6):
                add((name,kk),len(truth&set(order[:kk].tolist())),len(truth))
        if l+2<L:
            truth2=set(int(v) for v in ld(s,'ffn_moe_topk',l+2))
            lg=R[l+2]@(rms(fi)*W[l+2]); order=np.argsort(-lg)
            for kk in (2,4): add(('P1 dist2',kk),len(truth2&set(order[:kk].tolist())),len(truth2))
for k,(h,n) in sorted(res.items()): print('%-34s top-%d recall %.1f%%'%(k[0],k[1],100*h/n))
res.clear()
for s in steps:
    for l in range(L-2):
        truth2=set(int(v) for v in ld(s,'ffn_moe_topk',l+2))
        lo=ld(s,'l_out',l)
        lg=R[l+2]@(rms(lo)*W[l+2]); order=np.argsort(-lg)
        for kk in (2,4): add(('P2 l_out_l -> l+2',kk),len(truth2&set(order[:kk].tolist())),len(truth2))
    for l in range(1,L):
        truth=set(int(v) for v in ld(s,'ffn_moe_topk',l))
        # previous token's route of the same layer (temporal)
        if s-1 in steps:
            prev=set(int(v) for v in ld(s-1,'ffn_moe_topk',l)); add(('temporal',2),len(truth&prev),len(truth))
for k,(h,n) in sorted(res.items()): print('%-34s top-%d recall %.1f%%'%(k[0],k[1],100*h/n))
