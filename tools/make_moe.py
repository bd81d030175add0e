#!/usr/bin/env python3
"""MoE test models for LES (issue 3): deterministic, seeded GGUF writers.

  make_moe.py smolmoe --src models/SmolLM2-135M-Instruct.Q4_1.gguf --experts 32 --top-k 2 \
                      --out models/smolmoe-32x2.gguf
  make_moe.py random  --arch {llama,qwen2moe,qwen3moe,olmoe,qwen35moe,qwen3next,gpt-oss,smallthinker,lfm2moe} --src models/SmolLM2-...gguf \
                      --out models/rand-<arch>.gguf   (build_models.sh: rand-llama-moe for llama)
  make_moe.py full    --arch qwen35moe-35b-a3b --out models/qwen35moe-35b-a3b-rand.gguf  (~20 GB)
  make_moe.py stats   --src models/SmolLM2-...gguf --refs tests/fixtures/refs/SmolLM2-...json \
                      --experts 32 --top-k 2       (routing statistics of the SmolMoE router)

SmolMoE: SmolLM2-135M-Instruct turned into a Mixtral-style `llama` MoE. Every layer's dense FFN
(ffn_gate/ffn_up/ffn_down) becomes E experts stacked as ffn_{gate,up,down}_exps (ggml dims
[n_embd, n_ff, E] for gate/up, [n_ff, n_embd, E] for down, as convert_hf_to_gguf writes Mixtral).
Expert e of layer l is the dense tensor with a fraction `--flip` of its quantized codes moved by
+-1 (reflected at the code range ends; scale/min bytes untouched), positions and signs drawn from
PCG64 seeded with (seed, layer, expert, tensor). The router ffn_gate_inp (F32 [n_embd, E]) is
seeded Gaussian; per layer, the weights of SmolLM2's 4 massive-activation channels
(SMOL_ROUTER_ZERO_DIMS) are zeroed and the std is set so router logits have std ~= ROUTER_LOGIT_STD
on real activations (SMOL_FFN_IN_RMS). Both constants were measured once with `stats` on the
reference prompts and are committed below.

Random MoEs: small seeded models of each MoE architecture LES supports, with SmolLM2's vocabulary
and merges (tokenizer.ggml.* copied; `pre` set per architecture), expert tensors in a mix of
Q8_0 / Q4_K / Q6_K / F16 (quantized blocks are written directly from random codes and scales).

Determinism: only integer arithmetic on random integers, and Generator(PCG64).standard_normal
(float64) scaled and cast to f16/f32; no BLAS, no reductions. Same seed -> same bytes.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

QK = {t: gguf.GGML_QUANT_SIZES[t] for t in T}  # type -> (block elems, block bytes)


def rng_for(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


# ----------------------------------------------------------------------------------------------
# GGUF writing helpers (streaming: tensor infos first, then data one tensor at a time)
# ----------------------------------------------------------------------------------------------

class StreamWriter:
    """Collects (name, numpy-shape, dtype, nbytes, producer) and streams the data at write()."""

    def __init__(self, path: str, arch: str):
        self.w = gguf.GGUFWriter(path, arch)
        self.plan: list[tuple[str, object]] = []

    def kv(self, key: str, val, vtype: gguf.GGUFValueType, sub_type=None):
        self.w.add_key_value(key, val, vtype, sub_type=sub_type)

    def u32(self, key: str, v: int):
        self.w.add_uint32(key, int(v))

    def f32(self, key: str, v: float):
        self.w.add_float32(key, float(v))

    def s(self, key: str, v: str):
        self.w.add_string(key, v)

    def tensor(self, name: str, qtype: T, ne: tuple[int, ...], producer):
        """ne: ggml dims (ne0 = row length first). producer() -> np.ndarray with the raw data."""
        blk, tsz = QK[qtype]
        assert ne[0] % blk == 0, f"{name}: row length {ne[0]} not a multiple of {blk} for {qtype.name}"
        nbytes = ne[0] // blk * tsz
        for d in ne[1:]:
            nbytes *= d
        np_shape = tuple(reversed(ne))
        if qtype == T.F32:
            self.w.add_tensor_info(name, np_shape, np.dtype(np.float32), nbytes)
        elif qtype == T.F16:
            self.w.add_tensor_info(name, np_shape, np.dtype(np.float16), nbytes)
        else:
            byte_shape = np_shape[:-1] + (ne[0] // blk * tsz,)
            self.w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        self.plan.append((name, nbytes, producer))

    def write(self, progress: bool = False):
        w = self.w
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        n = len(self.plan)
        for i, (name, nbytes, producer) in enumerate(self.plan):
            data = producer()
            assert data.nbytes == nbytes, (name, data.nbytes, nbytes)
            w.write_tensor_data(np.ascontiguousarray(data))
            if progress and (i % 50 == 0 or i == n - 1):
                print(f"  [{i + 1}/{n}] {name}", file=sys.stderr)
        w.close()


def copy_kv(sw: StreamWriter, field, key: str | None = None):
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    sw.kv(key or field.name, field.contents(), vtype, sub)


# ----------------------------------------------------------------------------------------------
# Random tensors (quantized blocks written directly)
# ----------------------------------------------------------------------------------------------

def rand_f32(rng, ne, std, mean=0.0):
    n = int(np.prod(ne))
    return (rng.standard_normal(n) * std + mean).astype(np.float32).reshape(tuple(reversed(ne)))


def rand_uniform_f32(rng, ne, lo, hi):
    n = int(np.prod(ne))
    return (lo + (hi - lo) * rng.random(n)).astype(np.float32).reshape(tuple(reversed(ne)))


def rand_f16(rng, ne, std):
    n = int(np.prod(ne))
    return (rng.standard_normal(n) * std).astype(np.float16).reshape(tuple(reversed(ne)))


def rand_block_d(rng, nb, unit):
    """Per-block f16 scale: unit * U(0.75, 1.25)."""
    return (unit * (0.75 + 0.5 * rng.random(nb))).astype(np.float16)


def rand_q8_0(rng, ne, std):
    # w = d * q, q uniform in [-127, 127] (std 73.6)
    nb = int(np.prod(ne)) // 32
    d = rand_block_d(rng, nb, std / 73.6)
    q = rng.integers(-127, 128, size=(nb, 32), dtype=np.int16).astype(np.int8)
    out = np.empty((nb, 34), dtype=np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def pack_q4_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m: (nb, 8) ints in [0, 63] -> (nb, 12) uint8 as ggml's get_scale_min_k4 reads them."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def rand_q4_k(rng, ne, std):
    # w = d*sc_j*q - dmin*m_j with q in [0,15], sc_j in [40,63], dmin = 8d, m_j = sc_j*15//16
    # (so each 32-weight sub-block is centred up to d*sc*7.5 - 8d*m ~ rounding).
    nb = int(np.prod(ne)) // 256
    d = rand_block_d(rng, nb, std / (51.5 * 4.61))
    dmin = (d.astype(np.float32) * 8).astype(np.float16)  # exact: power-of-two multiple
    sc = rng.integers(40, 64, size=(nb, 8), dtype=np.int32)
    m = sc * 15 // 16
    qs = rng.integers(0, 256, size=(nb, 128), dtype=np.int32).astype(np.uint8)
    out = np.empty((nb, 144), dtype=np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    out[:, 4:16] = pack_q4_k_scales(sc, m)
    out[:, 16:] = qs
    return out


def rand_q6_k(rng, ne, std):
    # w = d * sc_j * (q - 32), q in [0, 63] (std 18.5), sc_j int8 with |sc_j| in [24, 127]
    nb = int(np.prod(ne)) // 256
    d = rand_block_d(rng, nb, std / (75.5 * 18.5))
    mag = rng.integers(24, 128, size=(nb, 16), dtype=np.int32)
    sign = rng.integers(0, 2, size=(nb, 16), dtype=np.int32) * 2 - 1
    sc = (mag * sign).astype(np.int8)
    ql = rng.integers(0, 256, size=(nb, 128), dtype=np.int32).astype(np.uint8)
    qh = rng.integers(0, 256, size=(nb, 64), dtype=np.int32).astype(np.uint8)
    out = np.empty((nb, 210), dtype=np.uint8)
    out[:, 0:128] = ql
    out[:, 128:192] = qh
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.view(np.uint8).reshape(nb, 2)
    return out


def rand_mxfp4(rng, ne, std):
    """block_mxfp4 {uint8 e; uint8 qs[16]} (ggml-common.h): random 4-bit codes (E2M1 values
    0, ±1, ±2, ±3, ±4, ±6, ±8, ±12 in ggml's doubled table; RMS 5.85) and a shared E8M0 scale
    d = 2^(e - 128) (GGML_E8M0_TO_FP32_HALF) near std / 5.85, one step up or down per block."""
    nb = int(np.prod(ne)) // 32
    e0 = 128 + int(round(math.log2(std / 5.85)))
    out = np.empty((nb, 17), np.uint8)
    out[:, 0] = (e0 + rng.integers(-1, 2, nb)).astype(np.uint8)
    out[:, 1:] = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
    return out


def rand_weight(rng, qtype: T, ne, std):
    if qtype == T.F32:
        return rand_f32(rng, ne, std)
    if qtype == T.F16:
        return rand_f16(rng, ne, std)
    fn = {T.Q8_0: rand_q8_0, T.Q4_K: rand_q4_k, T.Q6_K: rand_q6_k, T.MXFP4: rand_mxfp4}[qtype]
    blocks = fn(rng, ne, std)
    blk, tsz = QK[qtype]
    return blocks.reshape(tuple(reversed(ne[1:])) + (ne[0] // blk * tsz,))


# ----------------------------------------------------------------------------------------------
# Random MoE specs
# ----------------------------------------------------------------------------------------------

Q8, Q4K, Q6K, F16, F32 = T.Q8_0, T.Q4_K, T.Q6_K, T.F16, T.F32

RANDOM_SPECS = {
    # Mixtral-style llama MoE: normalised top-k weights, normal (non-NeoX) RoPE, tied output.
    "llama": dict(
        arch="llama", pre="llama-bpe", add_bos=True, seed=1001, logit_std=6.0, res_gain=4.0,
        n_embd=256, n_layer=4, n_head=8, n_head_kv=2, head_dim=32, n_expert=8, top_k=2, n_ff_exp=128,
        rope_base=10000.0, eps=1e-5, tied=True, embd_type=Q8, out_type=None,
        attn_types=[(Q8, Q8, Q8, Q8), (Q4K, Q4K, F16, Q8), (Q8, Q8, Q8, Q6K), (F16, F16, F16, F16)],
        exp_types=[(Q8, Q8, Q8), (Q4K, Q4K, Q8), (Q6K, Q6K, F16), (F16, F16, Q8)],
    ),
    # Qwen2-MoE: q/k/v biases, shared expert with sigmoid gate, softmax top-k weights NOT normalised.
    "qwen2moe": dict(
        arch="qwen2moe", pre="qwen2", add_bos=False, seed=1002, logit_std=6.0, res_gain=4.0,
        n_embd=256, n_layer=4, n_head=8, n_head_kv=4, head_dim=32, n_expert=16, top_k=4, n_ff_exp=64,
        n_ff_shexp=256, rope_base=1000000.0, eps=1e-6, tied=False, embd_type=Q8, out_type=Q6K,
        qkv_bias=True,
        attn_types=[(Q8, Q8, Q8, Q8), (F16, F16, F16, F16), (Q4K, Q4K, Q4K, Q8), (Q6K, Q6K, Q6K, Q6K)],
        exp_types=[(Q4K, Q4K, Q8), (Q8, Q8, F16), (Q6K, Q6K, Q8), (F16, F16, F16)],
        shexp_types=[(Q8, Q8, Q8), (Q6K, Q6K, Q6K), (Q4K, Q4K, Q4K), (F16, F16, F16)],
    ),
    # Qwen3-MoE: per-head QK RMSNorm, head_dim*n_head != n_embd, normalised top-k weights.
    "qwen3moe": dict(
        arch="qwen3moe", pre="qwen2", add_bos=False, seed=1003, logit_std=6.0, res_gain=8.0,
        n_embd=256, n_layer=4, n_head=8, n_head_kv=2, head_dim=64, n_expert=16, top_k=4, n_ff_exp=256,
        rope_base=1000000.0, eps=1e-6, tied=True, embd_type=Q8, out_type=None, qk_norm="head",
        attn_types=[(Q8, Q8, Q8, Q8), (Q4K, Q4K, Q4K, Q6K), (F16, F16, F16, F16), (Q6K, Q6K, Q8, Q4K)],
        exp_types=[(Q6K, Q6K, Q4K), (Q8, Q8, Q6K), (Q4K, Q4K, F16), (F16, Q4K, Q8)],
    ),
    # OLMoE: QK RMSNorm over the whole q / k vectors (n_embd wide; no GQA), top-k NOT normalised.
    "olmoe": dict(
        arch="olmoe", pre="olmo", add_bos=False, seed=1004, logit_std=6.0, res_gain=4.0,
        n_embd=128, n_layer=4, n_head=4, n_head_kv=4, head_dim=32, n_expert=12, top_k=3, n_ff_exp=256,
        rope_base=10000.0, eps=1e-5, tied=False, embd_type=F16, out_type=Q8, qk_norm="full",
        attn_types=[(Q8, Q8, Q8, Q8), (F16, F16, F16, F16), (Q8, Q8, F16, Q8), (F16, Q8, Q8, F16)],
        exp_types=[(Q8, Q8, Q4K), (F16, F16, Q6K), (Q8, F16, Q8), (F16, Q8, F16)],
    ),
    # SmallThinker (llama.cpp src/models/smallthinker.cpp): the router on the layer's input before
    # attention, sigmoid gating (expert_gating_func 2) with normalised top-k weights, ReGLU experts;
    # a sliding window in the file makes layers 1-3 slide (4096: llama.cpp's fixed value) and layers
    # 0 and 4 (il % 4 == 0) global NoPE layers (5 layers: with exactly 4, llama.cpp ropes every
    # layer). Router std 0.25/sqrt(D) times the layer input's RMS (not normed).
    "smallthinker": dict(
        arch="smallthinker", pre="smollm", add_bos=False, seed=1008, logit_std=6.0, res_gain=4.0,
        n_embd=256, n_layer=5, n_head=8, n_head_kv=2, head_dim=32, n_expert=16, top_k=4, n_ff_exp=128,
        rope_base=1000000.0, eps=1e-6, tied=False, embd_type=Q8, out_type=Q6K,
        gating_func=2, sliding_window=4096, router_std=0.25,
        attn_types=[(Q8, Q8, Q8, Q8), (Q4K, Q4K, Q6K, Q8), (F16, F16, F16, F16), (Q6K, Q6K, Q8, Q4K), (Q8, Q8, Q8, Q8)],
        exp_types=[(Q8, Q8, F16), (Q4K, Q4K, Q8), (F16, Q6K, Q8), (Q6K, Q6K, F16), (Q8, Q4K, Q8)],
    ),
}


# Hybrid (Gated DeltaNet + gated attention) MoEs, llama.cpp src/models/qwen35moe.cpp / qwen3next.cpp.
# Shapes llama.cpp's own random-model test (tests/test-llama-archs.cpp) misses: value heads = 2 x key
# heads (tiled vs grouped mapping), top-k > 1 of 16 experts, partial rotary (n_rot < head_dim).
HYBRID_SPECS = {
    # Float weights only (F32 / F16; the embedding lookup is exact whatever its type): a quantized
    # weight quantizes its activations, and one flipped rounding there moves a router's top-k, so
    # references from a llama.cpp build with other SIMD orders (AVX2 vs AVX-512 expf and dot
    # orders) would part within a few layers. The block formats have their own tests.
    "qwen35moe": dict(
        arch="qwen35moe", pre="qwen2", add_bos=False, seed=1005, logit_std=6.0, res_gain=4.0,
        n_embd=256, n_layer=4, interval=4, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
        sections=[3, 3, 2, 0], d_state=64, n_group=2, dt_rank=4, d_conv=4,
        n_expert=16, top_k=4, n_ff_exp=64, n_ff_shexp=128, rope_base=10000000.0, eps=1e-6,
        tied=False, embd_type=Q8, out_type=F16,
        # per layer: (attn_qkv | attn_q, attn_gate | attn_k, ssm_out | attn_v, ssm_beta/alpha | attn_output)
        mix_types=[(F32, F16, F16, F32), (F16, F32, F32, F16), (F32, F32, F16, F16), (F16, F32, F16, F32)],
        exp_types=[(F16, F16, F32), (F32, F32, F16), (F16, F32, F16), (F32, F16, F32)],
        shexp_types=[(F32, F32, F16), (F16, F16, F16), (F32, F16, F32), (F16, F32, F32)],
    ),
    # qwen35moe with one multi-token-prediction block after the trunk (`nextn_predict_layers` 1,
    # `blk.4.*` with `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm`; the
    # tensors of llama.cpp's `load_block_mtp`, src/models/qwen35moe.cpp).
    "qwen35moe-mtp": dict(
        arch="qwen35moe", pre="qwen2", add_bos=False, seed=1007, logit_std=6.0, res_gain=4.0,
        n_embd=256, n_layer=4, interval=4, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
        sections=[3, 3, 2, 0], d_state=64, n_group=2, dt_rank=4, d_conv=4,
        n_expert=16, top_k=4, n_ff_exp=64, n_ff_shexp=128, rope_base=10000000.0, eps=1e-6,
        tied=False, embd_type=Q8, out_type=F16, nextn=1,
        mix_types=[(F32, F16, F16, F32), (F16, F32, F32, F16), (F32, F32, F16, F16), (F16, F32, F16, F32)],
        exp_types=[(F16, F16, F32), (F32, F32, F16), (F16, F32, F16), (F32, F16, F32)],
        shexp_types=[(F32, F32, F16), (F16, F16, F16), (F32, F16, F32), (F16, F32, F32)],
    ),
    "qwen3next": dict(
        arch="qwen3next", pre="qwen2", add_bos=False, seed=1006, logit_std=6.0, res_gain=4.0,
        n_embd=256, n_layer=4, interval=2, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
        sections=None, d_state=64, n_group=2, dt_rank=4, d_conv=4,
        n_expert=16, top_k=4, n_ff_exp=64, n_ff_shexp=128, rope_base=10000000.0, eps=1e-6,
        tied=True, embd_type=F16, out_type=None,
        mix_types=[(F16, F16, F32, F32), (F32, F16, F16, F32), (F16, F32, F32, F16), (F32, F32, F16, F16)],
        exp_types=[(F32, F16, F16), (F16, F16, F32), (F32, F32, F16), (F16, F32, F32)],
        shexp_types=[(F16, F16, F32), (F32, F32, F16), (F16, F32, F16), (F32, F16, F32)],
    ),
}


# The seed's scale (issue 18): Qwen3.5/3.6-35B-A3B's exact hyper-parameters and tensor shapes
# (llama.cpp src/models/qwen35moe.cpp; ../shared/research/moe_archs.md §1.2-1.3) at Q4_K_M-like
# types (Q4_K, Q6_K on every other ffn_down / ssm_out / attn_v, Q6_K output, F32 norms, conv,
# router and beta/alpha), random weights, SmolLM2's tokenizer padded to the 248320-token vocabulary.
# About 20 GB; built on the fly by `make_moe.py full`, never committed. Types cycle by layer.
FULL_SPECS = {
    # gpt-oss-20b (issue 19's size check; ../shared/research/moe_archs.md §2.2-2.3): 24 layers of
    # 2880, 64 query / 8 KV heads of 64, 32 MXFP4 experts (top-4) of width 2880 with biases,
    # sliding window 128 on even layers, YaRN 32 over 4096, the o200k_harmony vocabulary's size
    # (201088: SmolLM2's tokens, the harmony tokens, then padding); everything but the experts in
    # Q8_0 (`llama-quantize MXFP4_MOE`'s choice). About 11.8 GB.
    "gpt-oss-20b": dict(
        arch="gpt-oss", pre="smollm", add_bos=False, seed=2001, logit_std=6.0, res_gain=1.0,
        n_embd=2880, n_layer=24, n_head=64, n_head_kv=8, head_dim=64, n_expert=32, top_k=4, n_ff_exp=2880,
        rope_base=150000.0, eps=1e-5, swa=128, yarn_factor=32.0, yarn_orig_ctx=4096,
        embd_type=Q8, out_type=Q8, exp_type=T.MXFP4, vocab=201088, context_length=131072,
        mix_types=[(Q8, Q8, Q8, Q8)],
    ),
    # SmallThinker-4B-A0.6B's shape (SJTU-IPADS/SmallThinker README: 32 layers of 1536, 12 query /
    # 2 KV heads of 128, 32 experts top-4 of width 768, ReGLU, vocabulary 151936, 32K context),
    # sigmoid routing and the sliding-window layout (NoPE on il % 4 == 0) as the small fixture;
    # Q4_K with Q6_K on every other ffn_down / attn_v, Q6_K output. About 2.4 GB.
    "smallthinker-4b-a0.6b": dict(
        arch="smallthinker", pre="smollm", add_bos=False, seed=3601, logit_std=6.0, res_gain=1.0,
        n_embd=1536, n_layer=32, n_head=12, n_head_kv=2, head_dim=128, n_expert=32, top_k=4, n_ff_exp=768,
        rope_base=1000000.0, eps=1e-6, tied=False, embd_type=Q4K, out_type=Q6K, vocab=151936,
        context_length=32768, gating_func=2, sliding_window=4096, router_std=0.25,
        attn_types=[(Q4K, Q4K, Q6K, Q4K), (Q4K, Q4K, Q4K, Q4K)],
        exp_types=[(Q4K, Q4K, Q6K), (Q4K, Q4K, Q4K)],
    ),
    "qwen35moe-35b-a3b": dict(
        arch="qwen35moe", pre="qwen2", add_bos=False, seed=3501, logit_std=6.0, res_gain=1.0,
        n_embd=2048, n_layer=40, interval=4, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
        sections=[11, 11, 10, 0], d_state=128, n_group=16, dt_rank=32, d_conv=4,
        n_expert=256, top_k=8, n_ff_exp=512, n_ff_shexp=512, rope_base=10000000.0, eps=1e-6,
        tied=False, embd_type=Q4K, out_type=Q6K, vocab=248320, context_length=262144,
        mix_types=[(Q4K, Q4K, Q4K, F32), (Q4K, Q4K, Q6K, F32), (Q4K, Q4K, Q4K, F32), (Q4K, Q4K, Q6K, Q4K)],
        exp_types=[(Q4K, Q4K, Q6K), (Q4K, Q4K, Q4K)],
        shexp_types=[(Q4K, Q4K, Q6K), (Q4K, Q4K, Q4K)],
    ),
}

# The same with one multi-token-prediction block (`nextn_predict_layers` 1, `blk.40.*`: as the
# small `qwen35moe-mtp` fixture's, its 256 experts in the trunk's first expert types), for the
# ladder's MTP rung (`les bench ladder --mtp`; issue 37 item 4). About 21.6 GB.
FULL_SPECS["qwen35moe-35b-a3b-mtp"] = dict(FULL_SPECS["qwen35moe-35b-a3b"], nextn=1)

# gpt-oss (llama.cpp src/models/openai-moe.cpp; ../shared/research/moe_archs.md §2): biased q/k/v/o
# and router, attention sinks, sliding-window attention on even layers (a window of 16 here, so
# the references' prompts run past it), YaRN (factor 32 over 4096 as gpt-oss-20b), experts in
# MXFP4 with biases and swiglu_oai; the harmony special tokens appended to SmolLM2's vocabulary.
GPTOSS_SPECS = {
    "gpt-oss": dict(
        arch="gpt-oss", pre="smollm", add_bos=False, seed=1007, logit_std=6.0, res_gain=0.5,
        n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_expert=16, top_k=4, n_ff_exp=64,
        rope_base=150000.0, eps=1e-5, swa=16, yarn_factor=32.0, yarn_orig_ctx=4096,
        embd_type=Q8, out_type=F16, exp_type=T.MXFP4,
        # Well-conditioned on purpose: MXFP4 experts quantize their inputs to Q8_0, so a last-bit
        # difference between two correct engines (f16 dot orders) can flip a quantization step or a
        # router choice; with small layer gains (res_gain, ffn_in_std) such a flip stays small
        # against the residual instead of growing layer by layer. Every 8th gate / up bias is
        # +-clamp_bias, beyond swiglu_oai's limit (7), so the clamps are exercised.
        ffn_in_std=0.5, clamp_bias=9.0,
        # per layer: (attn_q, attn_k, attn_v, attn_output)
        mix_types=[(F32, F16, F16, F32), (F16, F32, F32, F16), (F32, F32, F16, F16), (F16, F16, F32, F32)],
    ),
}
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>", "<|constrain|>", "<|call|>"]


def build_gptoss(arch_key: str, src: str, out: str, seed: int | None = None):
    sp = GPTOSS_SPECS.get(arch_key) or FULL_SPECS[arch_key]
    full = arch_key in FULL_SPECS
    arch = sp["arch"]
    seed = sp["seed"] if seed is None else seed
    r = gguf.GGUFReader(src)
    base = r.fields["tokenizer.ggml.tokens"].contents()
    n_vocab = len(base) + len(HARMONY_TOKENS)
    pad = max(0, sp.get("vocab", 0) - n_vocab)
    n_vocab += pad
    E, K, D, L = sp["n_expert"], sp["top_k"], sp["n_embd"], sp["n_layer"]
    H, HKV, HD, FF = sp["n_head"], sp["n_head_kv"], sp["head_dim"], sp["n_ff_exp"]
    sw = StreamWriter(out, arch)
    write_general(sw, arch, arch_key, seed, D, L, sp.get("context_length", 4096))
    u32 = lambda keys: [sw.u32(f"{arch}.{key}", v) for key, v in keys]  # noqa: E731
    u32([("feed_forward_length", FF), ("expert_feed_forward_length", FF), ("attention.head_count", H),
         ("attention.head_count_kv", HKV), ("attention.key_length", HD), ("attention.value_length", HD),
         ("rope.dimension_count", HD), ("expert_count", E), ("expert_used_count", K),
         ("attention.sliding_window", sp["swa"]), ("rope.scaling.original_context_length", sp["yarn_orig_ctx"])])
    sw.f32(f"{arch}.rope.freq_base", sp["rope_base"])
    sw.f32(f"{arch}.attention.layer_norm_rms_epsilon", sp["eps"])
    sw.s(f"{arch}.rope.scaling.type", "yarn")
    sw.f32(f"{arch}.rope.scaling.factor", sp["yarn_factor"])
    for k, f in r.fields.items():
        if not k.startswith("tokenizer.") or k == "tokenizer.chat_template":
            continue
        if k == "tokenizer.ggml.tokens":
            sw.kv(k, base + HARMONY_TOKENS + [f"<|pad_{i}|>" for i in range(pad)], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
        elif k == "tokenizer.ggml.token_type":
            sw.kv(k, f.contents() + [3] * len(HARMONY_TOKENS) + [5] * pad, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        elif k == "tokenizer.ggml.pre":
            sw.s(k, sp["pre"])
        elif k == "tokenizer.ggml.add_bos_token":
            sw.kv(k, bool(sp["add_bos"]), gguf.GGUFValueType.BOOL)
        elif k == "tokenizer.ggml.eos_token_id":
            sw.u32(k, len(base) + HARMONY_TOKENS.index("<|return|>"))
        else:
            copy_kv(sw, f)
    rnd = random_tensors(sw, seed, tile_above=(1 << 22) if full else 0)
    gain = sp["res_gain"]
    rnd("token_embd.weight", sp["embd_type"], (D, n_vocab), 1.0)
    for il in range(L):
        p = f"blk.{il}."
        tq, tk, tv, to = sp["mix_types"][il % len(sp["mix_types"])]
        rnd(p + "attn_norm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "post_attention_norm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "attn_q.weight", tq, (D, H * HD), 1 / math.sqrt(D))
        rnd(p + "attn_q.bias", T.F32, (H * HD,), 0.5)
        rnd(p + "attn_k.weight", tk, (D, HKV * HD), 1 / math.sqrt(D))
        rnd(p + "attn_k.bias", T.F32, (HKV * HD,), 0.5)
        rnd(p + "attn_v.weight", tv, (D, HKV * HD), 1 / math.sqrt(D))
        rnd(p + "attn_v.bias", T.F32, (HKV * HD,), 0.5)
        rnd(p + "attn_output.weight", to, (H * HD, D), gain / math.sqrt(H * HD))
        rnd(p + "attn_output.bias", T.F32, (D,), 0.5)
        # One logit per head joining the softmax's denominator, around the scores' own scale.
        rnd(p + "attn_sinks.weight", T.F32, (H,), 1.0)
        rnd(p + "ffn_gate_inp.weight", T.F32, (D, E), 2.0 / math.sqrt(D))
        rnd(p + "ffn_gate_inp.bias", T.F32, (E,), 1.0)
        ffn_in, spikes = sp.get("ffn_in_std", 2.0), sp.get("clamp_bias")
        bias_kind = ("spiky", 0.0, spikes) if spikes else ()
        rnd(p + "ffn_gate_exps.weight", sp["exp_type"], (D, FF, E), ffn_in / math.sqrt(D))
        rnd(p + "ffn_gate_exps.bias", T.F32, (FF, E), 1.0, *bias_kind)
        rnd(p + "ffn_up_exps.weight", sp["exp_type"], (D, FF, E), ffn_in / math.sqrt(D))
        rnd(p + "ffn_up_exps.bias", T.F32, (FF, E), 1.0, *bias_kind)
        rnd(p + "ffn_down_exps.weight", sp["exp_type"], (FF, D, E), gain / math.sqrt(FF))
        rnd(p + "ffn_down_exps.bias", T.F32, (D, E), 0.5)
    rnd("output_norm.weight", T.F32, (D,), 0, "norm")
    rnd("output.weight", sp["out_type"], (D, n_vocab), sp["logit_std"] / math.sqrt(D))
    sw.write()


# LFM2-MoE (llama.cpp src/models/lfm2.cpp + lfm2moe.cpp, converter conversion/lfm2.py): short-conv
# layers (C) and GQA layers (A) marked by a per-layer head_count_kv (0 = conv), per-head QK norm,
# `leading_dense_block_count` dense SwiGLU layers, then sigmoid routing with a selection bias
# (`exp_probs_b.bias`) and normalised weights; the output norm is `token_embd_norm`.
LFM2_SPECS = {
    "lfm2moe": dict(
        arch="lfm2moe", pre="smollm", add_bos=False, seed=1009, logit_std=6.0, res_gain=4.0,
        n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff=512, n_expert=16, top_k=4, n_ff_exp=128,
        layers="CCACAC", n_dense=1, l_cache=3, rope_base=1000000.0, eps=1e-5, embd_type=Q8, out_type=Q6K,
        probs_b_std=0.05,
        mix_types=[(Q8, Q8, Q8, Q8), (Q4K, Q4K, Q6K, Q8), (F16, F16, F16, F16)],
        exp_types=[(Q8, Q8, F16), (Q4K, Q4K, Q8), (F16, Q6K, Q8)],
    ),
    # LFM2-8B-A1B's shape (transformers `Lfm2MoeConfig` defaults and ../shared/research/
    # moe_archs_2026.md: 24 layers of 2048, 18 short-conv + 6 GQA (32 heads / 8 KV of 64), the
    # first 2 dense (7168), 32 experts top-4 of 1792, vocabulary 65536; the attention layers' places
    # here are an assumption, their count is not) at Q4_K / Q6_K; untied output. About 5.1 GB.
    "lfm2moe-8b-a1b": dict(
        arch="lfm2moe", pre="smollm", add_bos=False, seed=3701, logit_std=6.0, res_gain=1.0,
        n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=7168, n_expert=32, top_k=4, n_ff_exp=1792,
        layers="CCACCCACCCACCCACCCACCACC", n_dense=2, l_cache=3, rope_base=1000000.0, eps=1e-5,
        embd_type=Q4K, out_type=Q6K, probs_b_std=0.05, vocab=65536, context_length=128000, full=True,
        mix_types=[(Q4K, Q4K, Q6K, Q4K), (Q4K, Q4K, Q4K, Q4K)],
        exp_types=[(Q4K, Q4K, Q6K), (Q4K, Q4K, Q4K)],
    ),
}


def build_lfm2moe(arch_key: str, src: str, out: str, seed: int | None = None):
    sp = LFM2_SPECS[arch_key]
    arch = sp["arch"]
    seed = sp["seed"] if seed is None else seed
    r = gguf.GGUFReader(src)
    n_vocab = max(len(r.fields["tokenizer.ggml.tokens"].data), sp.get("vocab", 0))
    pattern = sp["layers"]
    E, K, D, L = sp["n_expert"], sp["top_k"], sp["n_embd"], len(pattern)
    H, HKV, HD, FF, DFF = sp["n_head"], sp["n_head_kv"], sp["head_dim"], sp["n_ff_exp"], sp["n_ff"]
    sw = StreamWriter(out, arch)
    write_general(sw, arch, arch_key, seed, D, L, sp.get("context_length", 4096))
    u32 = lambda keys: [sw.u32(f"{arch}.{key}", v) for key, v in keys]  # noqa: E731
    u32([("feed_forward_length", DFF), ("expert_feed_forward_length", FF), ("attention.head_count", H),
         ("rope.dimension_count", HD), ("expert_count", E), ("expert_used_count", K),
         ("leading_dense_block_count", sp["n_dense"]), ("expert_gating_func", 2), ("vocab_size", n_vocab),
         ("shortconv.l_cache", sp["l_cache"])])
    sw.kv(f"{arch}.attention.head_count_kv", [HKV if t == "A" else 0 for t in pattern], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    sw.f32(f"{arch}.rope.freq_base", sp["rope_base"])
    sw.f32(f"{arch}.attention.layer_norm_rms_epsilon", sp["eps"])
    copy_tokenizer(sw, r, sp)
    rnd = random_tensors(sw, seed, tile_above=(1 << 22) if sp.get("full") else 0)
    gain = sp["res_gain"]
    rnd("token_embd.weight", sp["embd_type"], (D, n_vocab), 1.0)
    for il, t in enumerate(pattern):
        p = f"blk.{il}."
        ta, tb, tc, td = sp["mix_types"][il % len(sp["mix_types"])]
        rnd(p + "attn_norm.weight", T.F32, (D,), 0, "norm")
        if t == "C":
            rnd(p + "shortconv.conv.weight", T.F32, (sp["l_cache"], D), 0.5)
            rnd(p + "shortconv.in_proj.weight", ta, (D, 3 * D), 1 / math.sqrt(D))
            rnd(p + "shortconv.out_proj.weight", td, (D, D), gain / math.sqrt(D))
        else:
            rnd(p + "attn_q.weight", ta, (D, H * HD), 1 / math.sqrt(D))
            rnd(p + "attn_k.weight", tb, (D, HKV * HD), 1 / math.sqrt(D))
            rnd(p + "attn_v.weight", tc, (D, HKV * HD), 1 / math.sqrt(D))
            rnd(p + "attn_output.weight", td, (H * HD, D), gain / math.sqrt(H * HD))
            rnd(p + "attn_q_norm.weight", T.F32, (HD,), 0, "norm")
            rnd(p + "attn_k_norm.weight", T.F32, (HD,), 0, "norm")
        rnd(p + "ffn_norm.weight", T.F32, (D,), 0, "norm")
        if il < sp["n_dense"]:
            dt = Q4K if sp.get("full") else Q8
            rnd(p + "ffn_gate.weight", dt, (D, DFF), 1 / math.sqrt(D))
            rnd(p + "ffn_up.weight", dt, (D, DFF), 1 / math.sqrt(D))
            rnd(p + "ffn_down.weight", Q8 if not sp.get("full") else Q6K, (DFF, D), gain / math.sqrt(DFF))
        else:
            moe_tensors(rnd, p, D, E, FF, gain, sp["exp_types"][il % len(sp["exp_types"])])
            rnd(p + "exp_probs_b.bias", T.F32, (E,), sp["probs_b_std"])
    rnd("token_embd_norm.weight", T.F32, (D,), 0, "norm")
    rnd("output.weight", sp["out_type"], (D, n_vocab), sp["logit_std"] / math.sqrt(D))
    sw.write()


def write_general(sw, arch, arch_key, seed, n_embd, n_layer, n_ctx=4096):
    """general.* and the size keys every random model has."""
    sw.s("general.type", "model")
    sw.s("general.name", "rand-llama-moe" if arch_key == "llama" else f"rand-{arch_key}")
    sw.s("general.description",
         f"LES random MoE test model ({arch}), tools/make_moe.py random --arch {arch_key} --seed {seed}")
    sw.u32("general.quantization_version", 2)
    sw.u32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q8_0))  # nominal: types are mixed
    sw.u32(f"{arch}.context_length", n_ctx)
    sw.u32(f"{arch}.embedding_length", n_embd)
    sw.u32(f"{arch}.block_count", n_layer)


def copy_tokenizer(sw, r, sp):
    """SmolLM2's tokenizer, with the pre-tokenizer and BOS flag of the spec; padded with unused
    tokens (`<|pad_N|>`, type 5) to sp["vocab"] when given."""
    pad = sp.get("vocab", 0) - len(r.fields["tokenizer.ggml.tokens"].data)
    for k, f in r.fields.items():
        if not k.startswith("tokenizer."):
            continue
        if pad > 0 and k == "tokenizer.ggml.tokens":
            toks = f.contents() + [f"<|pad_{i}|>" for i in range(pad)]
            sw.kv(k, toks, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
        elif pad > 0 and k == "tokenizer.ggml.token_type":
            sw.kv(k, f.contents() + [5] * pad, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        elif k == "tokenizer.ggml.pre":
            sw.s(k, sp["pre"])
        elif k == "tokenizer.ggml.add_bos_token":
            sw.kv(k, bool(sp["add_bos"]), gguf.GGUFValueType.BOOL)
        else:
            copy_kv(sw, f)


def random_tensors(sw, seed, tile_above=0):
    """rnd(name, qtype, ne, std, kind): a tensor whose data is drawn (when written) from its own
    generator, seeded with (seed, its index); kind "norm" draws U(lo, hi) (default 0.8-1.2);
    kind "spiky" (F32 only) draws N(0, std) and sets every 8th element to +hi, -hi, +hi, ...
    tile_above > 0: a weight of more elements than that is a pool of that many random elements
    repeated from a random offset (valid blocks, fast to make: the full-size models)."""
    tid = [0]

    def rnd(name, qtype, ne, std, kind="w", lo=0.8, hi=1.2):
        tid[0] += 1
        key = tid[0]

        def prod():
            rng = rng_for(seed, key)
            if kind == "norm":
                return rand_uniform_f32(rng, ne, lo, hi)
            if kind == "spiky":
                b = rand_f32(rng, ne, std).reshape(-1)
                b[::8] = np.where(np.arange(b[::8].size) % 2 == 0, hi, -hi)
                return b.reshape(tuple(reversed(ne)))
            n = int(np.prod(ne))
            if tile_above and n > tile_above and qtype not in (T.F32, T.F16):
                pool = rand_weight(rng, qtype, (ne[0], tile_above // ne[0]), std).reshape(-1)
                blk, tsz = QK[qtype]
                nbytes = n // blk * tsz
                start = int(rng.integers(0, pool.size // tsz)) * tsz
                data = np.resize(np.roll(pool, -start), nbytes)
                return data.reshape(tuple(reversed(ne[1:])) + (ne[0] // blk * tsz,))
            return rand_weight(rng, qtype, ne, std)
        sw.tensor(name, qtype, ne, prod)
    return rnd


def moe_tensors(rnd, p, D, E, FF, gain, exp_types, shexp=None, router_std=2.0):
    """A layer's router, stacked experts and (shexp = (width, types)) sigmoid-gated shared expert.
    router_std: times 1/sqrt(D), the router's std (2: inputs of RMS ~1)."""
    rnd(p + "ffn_gate_inp.weight", T.F32, (D, E), router_std / math.sqrt(D))
    tg, tu, td = exp_types
    rnd(p + "ffn_gate_exps.weight", tg, (D, FF, E), 1 / math.sqrt(D))
    rnd(p + "ffn_up_exps.weight", tu, (D, FF, E), 1 / math.sqrt(D))
    rnd(p + "ffn_down_exps.weight", td, (FF, D, E), gain / math.sqrt(FF))
    if shexp is not None:
        SF, (sg, su, sd) = shexp
        rnd(p + "ffn_gate_inp_shexp.weight", T.F32, (D,), 1 / math.sqrt(D))
        rnd(p + "ffn_gate_shexp.weight", sg, (D, SF), 1 / math.sqrt(D))
        rnd(p + "ffn_up_shexp.weight", su, (D, SF), 1 / math.sqrt(D))
        rnd(p + "ffn_down_shexp.weight", sd, (SF, D), gain / math.sqrt(SF))


def build_hybrid(arch_key: str, src: str, out: str, seed: int | None = None):
    sp = HYBRID_SPECS.get(arch_key) or FULL_SPECS[arch_key]
    full = arch_key in FULL_SPECS
    arch = sp["arch"]
    seed = sp["seed"] if seed is None else seed
    r = gguf.GGUFReader(src)
    n_vocab = max(sp.get("vocab", 0), len(r.fields["tokenizer.ggml.tokens"].data))
    E, K, D, L = sp["n_expert"], sp["top_k"], sp["n_embd"], sp["n_layer"]
    H, HKV, HD, FF, SF = sp["n_head"], sp["n_head_kv"], sp["head_dim"], sp["n_ff_exp"], sp["n_ff_shexp"]
    S, HK, HV, KC = sp["d_state"], sp["n_group"], sp["dt_rank"], sp["d_conv"]
    DI = S * HV
    CD = 2 * HK * S + DI
    NN = sp.get("nextn", 0)
    sw = StreamWriter(out, arch)
    write_general(sw, arch, arch_key, seed, D, L + NN, sp.get("context_length", 4096))
    if NN:
        sw.u32(f"{arch}.nextn_predict_layers", NN)
    u32 = lambda keys: [sw.u32(f"{arch}.{key}", v) for key, v in keys]  # noqa: E731
    u32([("feed_forward_length", 3 * FF), ("expert_feed_forward_length", FF),
         ("expert_shared_feed_forward_length", SF), ("attention.head_count", H),
         ("attention.head_count_kv", HKV), ("attention.key_length", HD),
         ("attention.value_length", HD), ("rope.dimension_count", sp["n_rot"])])
    if sp["sections"] is not None:
        sw.kv(f"{arch}.rope.dimension_sections", sp["sections"], gguf.GGUFValueType.ARRAY,
              sub_type=gguf.GGUFValueType.INT32)
    sw.f32(f"{arch}.rope.freq_base", sp["rope_base"])
    sw.f32(f"{arch}.attention.layer_norm_rms_epsilon", sp["eps"])
    u32([("expert_count", E), ("expert_used_count", K), ("ssm.conv_kernel", KC),
         ("ssm.state_size", S), ("ssm.group_count", HK), ("ssm.time_step_rank", HV),
         ("ssm.inner_size", DI), ("full_attention_interval", sp["interval"])])
    copy_tokenizer(sw, r, sp)
    rnd = random_tensors(sw, seed, tile_above=(1 << 22) if full else 0)
    gain = sp["res_gain"]
    rnd("token_embd.weight", sp["embd_type"], (D, n_vocab), sp["logit_std"] / math.sqrt(D) if sp["tied"] else 1.0)
    for il in range(L):
        p = f"blk.{il}."
        t0, t1, t2, t3 = sp["mix_types"][il % len(sp["mix_types"])]
        rnd(p + "attn_norm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "post_attention_norm.weight", T.F32, (D,), 0, "norm")
        if (il + 1) % sp["interval"] != 0:  # Gated DeltaNet layer
            rnd(p + "attn_qkv.weight", t0, (D, CD), 1 / math.sqrt(D))
            rnd(p + "attn_gate.weight", t1, (D, DI), 1 / math.sqrt(D))
            rnd(p + "ssm_conv1d.weight", T.F32, (KC, CD), 0.5)
            rnd(p + "ssm_dt.bias", T.F32, (HV,), 0.5)
            # ssm_a = -exp(A_log), A_log = log(U(1, 16)) as the HF initialisation
            rnd(p + "ssm_a", T.F32, (HV,), 0, "norm", -16.0, -1.0)
            if arch == "qwen3next":
                rnd(p + "ssm_ba.weight", t3, (D, 2 * HV), 1 / math.sqrt(D))
            else:
                rnd(p + "ssm_beta.weight", t3, (D, HV), 1 / math.sqrt(D))
                rnd(p + "ssm_alpha.weight", t3, (D, HV), 1 / math.sqrt(D))
            rnd(p + "ssm_norm.weight", T.F32, (S,), 0, "norm")
            rnd(p + "ssm_out.weight", t2, (DI, D), gain / math.sqrt(DI))
        else:  # gated full attention
            rnd(p + "attn_q.weight", t0, (D, 2 * H * HD), 1 / math.sqrt(D))
            rnd(p + "attn_k.weight", t1, (D, HKV * HD), 1 / math.sqrt(D))
            rnd(p + "attn_v.weight", t2, (D, HKV * HD), 1 / math.sqrt(D))
            rnd(p + "attn_q_norm.weight", T.F32, (HD,), 0, "norm")
            rnd(p + "attn_k_norm.weight", T.F32, (HD,), 0, "norm")
            rnd(p + "attn_output.weight", t3, (H * HD, D), gain / math.sqrt(H * HD))
        ni = len(sp["exp_types"])
        moe_tensors(rnd, p, D, E, FF, gain, sp["exp_types"][il % ni], (SF, sp["shexp_types"][il % ni]))
    for il in range(L, L + NN):  # MTP blocks: a full-attention MoE block plus the nextn tensors
        p = f"blk.{il}."
        rnd(p + "nextn.eh_proj.weight", T.F16, (2 * D, D), 1 / math.sqrt(2 * D))
        rnd(p + "nextn.enorm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "nextn.hnorm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "attn_norm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "post_attention_norm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "attn_q.weight", T.F16, (D, 2 * H * HD), 1 / math.sqrt(D))
        rnd(p + "attn_k.weight", T.F32, (D, HKV * HD), 1 / math.sqrt(D))
        rnd(p + "attn_v.weight", T.F16, (D, HKV * HD), 1 / math.sqrt(D))
        rnd(p + "attn_q_norm.weight", T.F32, (HD,), 0, "norm")
        rnd(p + "attn_k_norm.weight", T.F32, (HD,), 0, "norm")
        rnd(p + "attn_output.weight", T.F32, (H * HD, D), gain / math.sqrt(H * HD))
        moe_tensors(rnd, p, D, E, FF, gain, sp["exp_types"][0], (SF, sp["shexp_types"][0]))
        rnd(p + "nextn.shared_head_norm.weight", T.F32, (D,), 0, "norm")
    rnd("output_norm.weight", T.F32, (D,), 0, "norm")
    if not sp["tied"]:
        rnd("output.weight", sp["out_type"], (D, n_vocab), sp["logit_std"] / math.sqrt(D))
    sw.write(progress=full)


def build_random(arch_key: str, src: str, out: str, seed: int | None = None):
    if arch_key in HYBRID_SPECS:
        return build_hybrid(arch_key, src, out, seed)
    if arch_key in GPTOSS_SPECS:
        return build_gptoss(arch_key, src, out, seed)
    if arch_key in LFM2_SPECS:
        return build_lfm2moe(arch_key, src, out, seed)
    sp = RANDOM_SPECS.get(arch_key) or FULL_SPECS[arch_key]
    full = arch_key in FULL_SPECS
    arch = sp["arch"]
    seed = sp["seed"] if seed is None else seed
    r = gguf.GGUFReader(src)
    n_vocab = max(len(r.fields["tokenizer.ggml.tokens"].data), sp.get("vocab", 0))
    E, K, D, L = sp["n_expert"], sp["top_k"], sp["n_embd"], sp["n_layer"]
    H, HKV, HD, FF = sp["n_head"], sp["n_head_kv"], sp["head_dim"], sp["n_ff_exp"]

    sw = StreamWriter(out, arch)
    write_general(sw, arch, arch_key, seed, D, L, sp.get("context_length", 4096))
    if arch == "qwen2moe":
        ff_key = sp["n_ff_shexp"]        # as convert_hf_to_gguf: intermediate_size (unused by llama.cpp)
    elif arch == "qwen3moe":
        ff_key = 3 * FF                  # dense intermediate_size, not the expert size
    else:
        ff_key = FF                      # llama / olmoe: expert FFN size
    sw.u32(f"{arch}.feed_forward_length", ff_key)
    if arch in ("qwen2moe", "qwen3moe", "smallthinker"):
        sw.u32(f"{arch}.expert_feed_forward_length", FF)
    if arch == "smallthinker":
        sw.u32(f"{arch}.expert_gating_func", sp["gating_func"])
        if sp.get("sliding_window"):
            sw.u32(f"{arch}.attention.sliding_window", sp["sliding_window"])
    if arch == "qwen2moe":
        sw.u32(f"{arch}.expert_shared_feed_forward_length", sp["n_ff_shexp"])
    sw.u32(f"{arch}.attention.head_count", H)
    sw.u32(f"{arch}.attention.head_count_kv", HKV)
    if H * HD != D:
        sw.u32(f"{arch}.attention.key_length", HD)
        sw.u32(f"{arch}.attention.value_length", HD)
    sw.u32(f"{arch}.rope.dimension_count", HD)
    sw.f32(f"{arch}.rope.freq_base", sp["rope_base"])
    sw.f32(f"{arch}.attention.layer_norm_rms_epsilon", sp["eps"])
    sw.u32(f"{arch}.expert_count", E)
    sw.u32(f"{arch}.expert_used_count", K)
    if arch == "llama":
        sw.u32(f"{arch}.vocab_size", n_vocab)
    copy_tokenizer(sw, r, sp)
    rnd = random_tensors(sw, seed, tile_above=(1 << 22) if full else 0)

    qdim, kvdim = H * HD, HKV * HD
    logit_std = sp["logit_std"]  # std of the output logits for an RMS-1 final hidden state
    # residual-branch gain (attn_output, ffn_down*): with tied embeddings a token's own embedding in
    # the residual stream boosts its own logit; a larger residual stream dilutes that (fewer loops)
    # (tuned so that greedy text is not one token repeated and top-2 margins are mostly > 0.1)
    gain = sp["res_gain"]
    rnd("token_embd.weight", sp["embd_type"], (D, n_vocab), logit_std / math.sqrt(D) if sp["tied"] else 1.0)
    for il in range(L):
        p = f"blk.{il}."
        tq, tk, tv, to = sp["attn_types"][il % len(sp["attn_types"])]
        rnd(p + "attn_norm.weight", T.F32, (D,), 0, "norm")
        rnd(p + "attn_q.weight", tq, (D, qdim), 1 / math.sqrt(D))
        rnd(p + "attn_k.weight", tk, (D, kvdim), 1 / math.sqrt(D))
        rnd(p + "attn_v.weight", tv, (D, kvdim), 1 / math.sqrt(D))
        if sp.get("qkv_bias"):
            rnd(p + "attn_q.bias", T.F32, (qdim,), 0.1)
            rnd(p + "attn_k.bias", T.F32, (kvdim,), 0.1)
            rnd(p + "attn_v.bias", T.F32, (kvdim,), 0.1)
        if sp.get("qk_norm") == "head":
            rnd(p + "attn_q_norm.weight", T.F32, (HD,), 0, "norm")
            rnd(p + "attn_k_norm.weight", T.F32, (HD,), 0, "norm")
        elif sp.get("qk_norm") == "full":
            rnd(p + "attn_q_norm.weight", T.F32, (qdim,), 0, "norm")
            rnd(p + "attn_k_norm.weight", T.F32, (kvdim,), 0, "norm")
        rnd(p + "attn_output.weight", to, (qdim, D), gain / math.sqrt(qdim))
        rnd(p + "ffn_norm.weight", T.F32, (D,), 0, "norm")
        shexp = (sp["n_ff_shexp"], sp["shexp_types"][il]) if arch == "qwen2moe" else None
        moe_tensors(rnd, p, D, E, FF, gain, sp["exp_types"][il % len(sp["exp_types"])], shexp, sp.get("router_std", 2.0))
    rnd("output_norm.weight", T.F32, (D,), 0, "norm")
    if not sp["tied"]:
        rnd("output.weight", sp["out_type"], (D, n_vocab), logit_std / math.sqrt(D))
    sw.write()


# ----------------------------------------------------------------------------------------------
# SmolMoE
# ----------------------------------------------------------------------------------------------

def perturb_codes(raw: np.ndarray, qtype: T, frac: float, rng: np.random.Generator) -> np.ndarray:
    """Move a fraction `frac` of the quantized codes by +-1 (reflected at the range ends).
    Scale/min bytes are untouched. raw: uint8 array of whole blocks."""
    blk, tsz = QK[qtype]
    blocks = raw.reshape(-1, tsz).copy()
    nb = blocks.shape[0]
    ncodes = nb * blk
    k = int(frac * ncodes)
    pos = np.unique(rng.integers(0, ncodes, size=k, dtype=np.int64))
    sign = (rng.integers(0, 2, size=pos.size, dtype=np.int16) * 2 - 1)
    b = pos // blk
    c = pos % blk
    if qtype in (T.Q4_0, T.Q4_1):
        hdr = 2 if qtype == T.Q4_0 else 4
        byte = hdr + (c % 16)
        for half in (0, 1):  # low nibbles (codes 0..15), then high nibbles (codes 16..31)
            sel = (c // 16) == half
            bb, by, sg = b[sel], byte[sel], sign[sel]
            shift = 4 * half
            v = blocks[bb, by].astype(np.int16)
            nib = (v >> shift) & 15
            new = nib + sg
            new = np.where(new < 0, 1, np.where(new > 15, 14, new))
            v = (v & (0xF0 if half == 0 else 0x0F)) | (new << shift)
            blocks[bb, by] = v.astype(np.uint8)
    elif qtype == T.Q8_0:
        q = blocks[:, 2:].view(np.int8)
        v = q[b, c].astype(np.int16) + sign
        v = np.where(v < -127, -126, np.where(v > 127, 126, v))
        q[b, c] = v.astype(np.int8)
    else:
        raise SystemExit(f"perturb: unsupported FFN type {qtype.name} (supported: Q4_0, Q4_1, Q8_0)")
    return blocks.reshape(raw.shape)


# Router calibration for SmolLM2-135M-Instruct Q4_1, measured by `make_moe.py stats` (numpy forward
# of the dense model on the 8 reference prompts + their llama.cpp greedy continuations, 328 tokens)
# and committed, so the build never depends on floating-point reductions:
#  - SMOL_ROUTER_ZERO_DIMS[l]: the 4 dims of the router input (ffn_norm output) with the largest
#    |mean| over tokens (the "massive activation" channels). Their router weights are zeroed:
#    otherwise a near-constant direction decides routing and one expert takes most tokens
#    (layer 29: 67% of top-1 picks);
#  - SMOL_FFN_IN_RMS[l]: RMS of the remaining dims, so router logits get std ~= ROUTER_LOGIT_STD.
# Fraction of each expert tensor's quantized codes moved by +-1 (see tests/fixtures/moe/README.md:
# 2%, 5%, 10%, 20% tried; 5% keeps greedy text fluent and close to the dense model).
SMOL_FLIP = 0.05

SMOL_ROUTER_ZERO_DIMS: list[list[int]] = [
    [59, 260, 322, 387], [100, 118, 260, 409], [118, 260, 308, 507], [118, 260, 308, 507], [260, 308, 371, 507],
    [260, 308, 371, 507], [118, 260, 308, 507], [118, 260, 308, 507], [260, 308, 371, 507], [14, 260, 308, 507],
    [14, 308, 371, 507], [14, 247, 308, 371], [14, 247, 308, 371], [14, 247, 308, 371], [14, 247, 308, 371],
    [243, 247, 308, 371], [14, 243, 247, 308], [14, 243, 247, 308], [14, 243, 247, 308], [14, 243, 247, 308],
    [243, 247, 308, 371], [14, 243, 247, 371], [14, 243, 247, 371], [14, 243, 247, 371], [17, 243, 247, 371],
    [17, 243, 247, 521], [17, 243, 247, 521], [17, 243, 507, 521], [17, 243, 507, 521], [17, 243, 299, 507],
]
SMOL_FFN_IN_RMS: list[float] = [
    0.081, 0.0811, 0.0905, 0.0925, 0.105, 0.111, 0.112, 0.116, 0.119, 0.118,
    0.119, 0.123, 0.114, 0.117, 0.115, 0.118, 0.118, 0.117, 0.126, 0.135,
    0.14, 0.159, 0.167, 0.183, 0.185, 0.194, 0.206, 0.209, 0.21, 0.247,
]
ROUTER_LOGIT_STD = 1.0


def smol_router(seed: int, il: int, n_expert: int, n_embd: int, zero_dims: list[int], rms: float,
                logit_std: float) -> np.ndarray:
    """F32 (n_expert, n_embd) = ggml [n_embd, n_expert]."""
    n_used = n_embd - len(zero_dims)
    std = logit_std / (rms * math.sqrt(n_used))
    rng = rng_for(seed, il, 1_000_000)
    w = (rng.standard_normal(n_expert * n_embd) * std).astype(np.float32).reshape(n_expert, n_embd)
    w[:, zero_dims] = 0.0
    return w


def build_smolmoe(src: str, out: str, n_expert: int, top_k: int, flip: float, seed: int,
                  router_logit_std: float = ROUTER_LOGIT_STD, progress: bool = True):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    assert arch == "llama", arch
    n_embd = r.fields["llama.embedding_length"].contents()
    n_layer = r.fields["llama.block_count"].contents()
    if len(SMOL_FFN_IN_RMS) != n_layer or len(SMOL_ROUTER_ZERO_DIMS) != n_layer:
        raise SystemExit("router calibration constants do not match the source model's layer count")
    sw = StreamWriter(out, "llama")
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
    for k, f in r.fields.items():
        if k in skip:
            continue
        if k == "general.name":
            sw.s(k, f"SmolMoE-{n_expert}x{top_k}")
            continue
        copy_kv(sw, f)
    sw.u32("llama.expert_count", n_expert)
    sw.u32("llama.expert_used_count", top_k)
    sw.s("general.description",
         f"SmolMoE-{n_expert}x{top_k}: Mixtral-style MoE upcycled from SmolLM2-135M-Instruct Q4_1 by LES "
         f"tools/make_moe.py (experts = dense FFN with {flip:g} of the quantized codes moved by +-1, "
         f"seed {seed}; router seeded Gaussian)")
    sw.u32("les.smolmoe.seed", seed)
    sw.f32("les.smolmoe.flip_fraction", flip)
    sw.f32("les.smolmoe.router_logit_std", router_logit_std)

    kinds = {"ffn_gate": (0, "ffn_gate_exps"), "ffn_up": (1, "ffn_up_exps"), "ffn_down": (2, "ffn_down_exps")}
    routers_done = set()
    for t in r.tensors:
        parts = t.name.split(".")
        qtype = T(t.tensor_type)
        ne = tuple(int(x) for x in t.shape)
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in kinds and parts[3] == "weight":
            il = int(parts[1])
            if il not in routers_done:
                routers_done.add(il)

                def prod_router(il=il):
                    return smol_router(seed, il, n_expert, n_embd, SMOL_ROUTER_ZERO_DIMS[il],
                                       SMOL_FFN_IN_RMS[il], router_logit_std)
                sw.tensor(f"blk.{il}.ffn_gate_inp.weight", T.F32, (n_embd, n_expert), prod_router)
            kind, newname = kinds[parts[2]]

            def prod_exps(t=t, il=il, kind=kind, qtype=qtype):
                base = np.asarray(t.data)
                outa = np.empty((n_expert,) + base.shape, dtype=np.uint8)
                for e in range(n_expert):
                    outa[e] = perturb_codes(base, qtype, flip, rng_for(seed, il, e, kind))
                return outa
            sw.tensor(f"blk.{il}.{newname}.weight", qtype, ne + (n_expert,), prod_exps)
        else:
            sw.tensor(t.name, qtype, ne, (lambda t=t: np.asarray(t.data)))
    sw.write(progress=progress)


# ----------------------------------------------------------------------------------------------
# numpy reference forward of the dense SmolLM2 (router statistics only; not used to build)
# ----------------------------------------------------------------------------------------------

def smol_ffn_inputs(src: str, seqs: list[list[int]]):
    """Yields (layer, X) with X = ffn_norm output rows for all tokens of all seqs (dense model)."""
    r = gguf.GGUFReader(src)
    g = lambda k: r.fields[k].contents()  # noqa: E731
    D, L = g("llama.embedding_length"), g("llama.block_count")
    H, HKV = g("llama.attention.head_count"), g("llama.attention.head_count_kv")
    eps, base = g("llama.attention.layer_norm_rms_epsilon"), g("llama.rope.freq_base")
    HD = D // H
    tens = {t.name: t for t in r.tensors}

    def W(name):
        t = tens[name]
        return gguf.quants.dequantize(t.data, T(t.tensor_type)).astype(np.float32)

    def rmsnorm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos):  # x: (n, h, HD), llama "normal" rope (adjacent pairs)
        inv = base ** (-np.arange(0, HD, 2, dtype=np.float64) / HD)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        o = np.empty_like(x)
        o[..., 0::2] = x0 * cos - x1 * sin
        o[..., 1::2] = x0 * sin + x1 * cos
        return o

    emb = W("token_embd.weight")
    xs = [emb[np.array(s)] for s in seqs]
    for il in range(L):
        p = f"blk.{il}."
        wq, wk, wv, wo = W(p + "attn_q.weight"), W(p + "attn_k.weight"), W(p + "attn_v.weight"), W(p + "attn_output.weight")
        wg, wu, wd = W(p + "ffn_gate.weight"), W(p + "ffn_up.weight"), W(p + "ffn_down.weight")
        an, fn = W(p + "attn_norm.weight"), W(p + "ffn_norm.weight")
        hs, new_xs = [], []
        for x in xs:
            n = x.shape[0]
            pos = np.arange(n)
            h = rmsnorm(x, an)
            q = rope((h @ wq.T).reshape(n, H, HD), pos)
            k = rope((h @ wk.T).reshape(n, HKV, HD), pos)
            v = (h @ wv.T).reshape(n, HKV, HD)
            k = np.repeat(k, H // HKV, axis=1)
            v = np.repeat(v, H // HKV, axis=1)
            att = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
            att = att + np.triu(np.full((n, n), -np.inf), 1)[None]
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hqk,khd->qhd", att, v).reshape(n, D)
            x = x + o @ wo.T
            h = rmsnorm(x, fn)
            a = h @ wg.T
            x = x + ((a / (1 + np.exp(-a))) * (h @ wu.T)) @ wd.T
            hs.append(h)
            new_xs.append(x)
        xs = new_xs
        yield il, np.concatenate(hs)
    # final logits of the last token of each sequence (sanity check vs llama.cpp)
    on = W("output_norm.weight")
    yield -1, np.stack([rmsnorm(x[-1], on) @ emb.T for x in xs])


def cmd_stats(a):
    """Measure router inputs on real text, derive the calibration constants, report routing."""
    import json
    ref = json.load(open(a.refs))
    seqs = [p["prompt_tokens"] + p["generated"] for p in ref["prompts"]]
    E, K = a.experts, a.top_k
    zero_all, rms_all = [], []
    print(f"{'layer':>5} {'rms':>7}  zeroed dims        {'H/lnE':>6} {'hot/unif':>8} {'overlap':>7} {'w1':>5}")
    for il, X in smol_ffn_inputs(a.src, seqs):
        if il < 0:
            want = [p["rows"][len(p["generated"])]["argmax"] for p in ref["prompts"]]
            print("check: numpy final-row argmax", [int(x) for x in X.argmax(-1)], "llama.cpp", want)
            continue
        X = X.astype(np.float64)
        n = X.shape[1]
        zero = sorted(int(i) for i in np.argsort(-np.abs(X.mean(0)))[:4])
        keep = np.setdiff1d(np.arange(n), zero)
        rms = float(f"{float(np.sqrt((X[:, keep] ** 2).mean())):.3g}")
        zero_all.append(zero)
        rms_all.append(rms)
        R = smol_router(a.seed, il, E, n, zero, rms, a.router_logit_std).astype(np.float64)
        lg = X @ R.T
        top = np.argsort(-lg, axis=1)[:, :K]
        cnt = np.bincount(top.ravel(), minlength=E) / top.size
        nz = cnt[cnt > 0]
        ent = float(-(nz * np.log(nz)).sum() / math.log(E))
        ov = float(np.mean([len(set(top[i]) & set(top[i - 1])) / K for i in range(1, len(top))]))
        pr = np.exp(lg - lg.max(1, keepdims=True))
        ps = np.take_along_axis(pr, top, 1)
        w1 = float((ps[:, 0] / ps.sum(1)).mean())
        print(f"{il:>5} {rms:7.3g}  {str(zero):18s} {ent:6.3f} {cnt.max() * E:8.2f} {ov:7.3f} {w1:5.2f}"
              f"   logit std {lg.std(1).mean():.2f}")
    print("H/lnE: entropy of expert usage (all top-k picks) / ln E; hot/unif: busiest expert's share x E;")
    print(f"overlap: mean fraction of a token's top-{K} also used by the previous token (random: {K / E:.3f});")
    print("w1: mean normalised weight of the top-1 expert.")
    print("SMOL_ROUTER_ZERO_DIMS = " + json.dumps(zero_all))
    print("SMOL_FFN_IN_RMS = " + json.dumps(rms_all))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("smolmoe")
    s.add_argument("--src", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    s.add_argument("--out", required=True)
    s.add_argument("--experts", type=int, default=32)
    s.add_argument("--top-k", type=int, default=2)
    s.add_argument("--flip", type=float, default=None, help=f"fraction of codes moved by +-1 per expert (default {SMOL_FLIP})")
    s.add_argument("--seed", type=int, default=20251)
    s.add_argument("--router-logit-std", type=float, default=ROUTER_LOGIT_STD)
    s = sub.add_parser("random")
    s.add_argument("--arch", required=True, choices=sorted(RANDOM_SPECS) + sorted(HYBRID_SPECS) + sorted(GPTOSS_SPECS) + sorted(LFM2_SPECS))
    s.add_argument("--src", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=None)
    s = sub.add_parser("full", help="a full-size random model (12-21 GB; not for CI)")
    s.add_argument("--arch", default="qwen35moe-35b-a3b", choices=sorted(FULL_SPECS) + ["lfm2moe-8b-a1b"])
    s.add_argument("--src", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    s.add_argument("--out", required=True)
    s = sub.add_parser("stats")
    s.add_argument("--src", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    s.add_argument("--refs", default="tests/fixtures/refs/SmolLM2-135M-Instruct.Q4_1.json")
    s.add_argument("--experts", type=int, default=32)
    s.add_argument("--top-k", type=int, default=2)
    s.add_argument("--seed", type=int, default=20251)
    s.add_argument("--router-logit-std", type=float, default=ROUTER_LOGIT_STD)
    a = ap.parse_args()
    if a.cmd == "smolmoe":
        build_smolmoe(a.src, a.out, a.experts, a.top_k, SMOL_FLIP if a.flip is None else a.flip, a.seed,
                      a.router_logit_std)
    elif a.cmd == "random":
        build_random(a.arch, a.src, a.out, a.seed)
    elif a.cmd == "full" and a.arch in LFM2_SPECS:
        build_lfm2moe(a.arch, a.src, a.out)
    elif a.cmd == "full" and FULL_SPECS[a.arch]["arch"] == "gpt-oss":
        build_gptoss(a.arch, a.src, a.out)
    elif a.cmd == "full" and FULL_SPECS[a.arch]["arch"] == "smallthinker":
        build_random(a.arch, a.src, a.out)
    elif a.cmd == "full":
        build_hybrid(a.arch, a.src, a.out)
    else:
        cmd_stats(a)


if __name__ == "__main__":
    main()
