#!/usr/bin/env python3
"""Offline recall of lookahead predictors on SmolMoE-32x2 (issue 4 analysis, session 5).

  LES_DEBUG_DUMP_DIR=/tmp/dd target/release/les run --model models/smolmoe-32x2.gguf \
      --prompt "Once upon a time, in a small village by the sea," -n 40 --temp 0
  python3 tools/predictor_recall.py [--partial]

For every decode step and layer, routes layer l+1 (and l+2) from hidden states LES dumped while
running (ffn_inp, l_out, ffn_moe_topk per layer) with the model's own routers and ffn_norm
weights (read with the gguf package), and prints recall of the true top-k at several
candidate counts. `P0` (the true input) must give 100%: a check that dumps and weights align.

`--partial` (session 6, the refinement stage): also routes layer l+1 from layer l's output with
only one of its experts added (what the scheduler has after the first expert is computed). Each
expert's output is recomputed from the dumped `ffn_norm` with weights dequantized by the gguf
package; "both" must equal `l_out`'s recall (a check of that recomputation). ~2 min.
"""
import numpy as np, gguf, os, sys
from gguf.quants import dequantize
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

if '--partial' in sys.argv:
    F=1536; cache={}
    def wt(kind,l,e,shape):
        if (kind,l,e) not in cache:
            t=T[f'blk.{l}.ffn_{kind}_exps.weight']
            cache[(kind,l,e)]=dequantize(np.array(t.data)[e],t.tensor_type).reshape(shape)
        return cache[(kind,l,e)]
    def expert(l,e,xn):
        g=wt('gate',l,e,(F,D))@xn; u=wt('up',l,e,(F,D))@xn
        return wt('down',l,e,(D,F))@(g/(1+np.exp(-g))*u)
    res.clear()
    for s in steps:
        for l in range(L-1):
            truth=set(int(v) for v in ld(s,'ffn_moe_topk',l+1))
            fi=ld(s,'ffn_inp',l); xn=ld(s,'ffn_norm',l)
            top=[int(v) for v in ld(s,'ffn_moe_topk',l)]; w=ld(s,'ffn_moe_weights',l)
            outs=[w[i]*expert(l,top[i],xn) for i in range(K)]
            for name,h in {'partial: rank-1 expert only':fi+outs[0],'partial: rank-2 expert only':fi+outs[1],'partial: both (= l_out)':fi+outs[0]+outs[1]}.items():
                order=np.argsort(-(R[l+1]@(rms(h)*W[l+1])))
                for kk in (2,4): add((name,kk),len(truth&set(order[:kk].tolist())),len(truth))
    for k,(h,n) in sorted(res.items()): print('%-34s top-%d recall %.1f%%'%(k[0],k[1],100*h/n))
