#!/usr/bin/env python3
"""MiniCPM-V 4.6-style vision-language test fixtures for LES: deterministic, seeded GGUF writers and
test images (llama.cpp references: tools/make_vision_refs.sh).

  make_vlm.py mmproj   [--out models/rand-minicpmv-mmproj.gguf]
  make_vlm.py text     --arch {qwen35,qwen35moe} [--src models/SmolLM2-135M-Instruct.Q4_1.gguf]
                       [--out models/rand-qwen35-vl.gguf | models/rand-qwen35moe-vl.gguf]
  make_vlm.py images   [--dir tests/data/vision]
  make_vlm.py mmproj --bench --out models/bench-minicpmv46-mmproj.gguf   (MiniCPM-V 4.6's tower size)
  make_vlm.py bench-images [--dir target/bench-vision]
  make_vlm.py all      (the three models and the images, default paths)

mmproj: a small `minicpmv4_6` projector (general.architecture "clip", llama.cpp
tools/mtmd/clip.cpp PROJECTOR_TYPE_MINICPMV4_6, graph tools/mtmd/models/minicpmv.cpp):
SigLIP-style ViT (patch 14, slice size 224, width 96, 3 heads of 32, 4 layers, GELU-tanh MLP of 256)
with the ViT merger (2x2 window attention + 2x2 downsample MLP) inserted after layer 1
(clip.vision.wa_layer_indexes = [1]), post-LN, and the final DownsampleMLP merger (2x2 concat ->
LayerNorm(384) -> up 384x256 -> GELU-erf -> down 256x128): 16x fewer tokens than patches
(clip.vision.projector.scale_factor = 4), 128-wide outputs = the text towers' n_embd.
All vision weights F32 except v.position_embd.weight (F16: a get_rows lookup, exact in f32).
The position table has 70*70 = 4900 rows because llama.cpp buckets patch positions on a hard-coded
70x70 grid (clip.cpp, PROJECTOR_TYPE_MINICPMV4_6 set_input: bucket = floor(70*i/n)).

text: a small dense `qwen35` (Gated DeltaNet + gated attention, dense SwiGLU FFN, IMROPE) and a
small `qwen35moe` text tower, both 128 wide, 4 layers (qwen35: full attention every 2nd layer, SwiGLU
384, tied embeddings; qwen35moe: every 4th, 8 experts top-2 of 64 + a 128-wide shared expert, separate
output), heads 4 (kv 2) of 64, n_rot 16, sections [3,3,2,0], DeltaNet 2 key / 4 value heads of 64,
float weights (F32 / F16), with a vocabulary
of SmolLM2's first VOCAB_BASE tokens (its BPE merges truncated to the ones producing those tokens:
SmolLM2's token id = merge rank + 252) plus the MiniCPM-V marker tokens `<image>`, `</image>`,
`<slice>`, `</slice>` as control tokens ("\\n" is SmolLM2's byte token "Ċ"), and a ChatML
chat template (llama-mtmd-cli refuses a model without one).

images: deterministic test pictures (numpy patterns, saved with Pillow) and bad inputs.

Determinism: Generator(PCG64).standard_normal (float64) scaled and cast; no BLAS, no reductions.
Same seed -> same bytes (images: same pixels; PNG/JPEG bytes also depend on Pillow's zlib/libjpeg).
"""
from __future__ import annotations

import argparse
import math
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf  # noqa: E402
from make_moe import T, StreamWriter, moe_tensors, random_tensors  # noqa: E402

F16, F32 = T.F16, T.F32

# ----------------------------------------------------------------------------------------------
# mmproj (minicpmv4_6)
# ----------------------------------------------------------------------------------------------

MMPROJ_SPEC = dict(
    seed=4600,
    image_size=224,        # slice size (HF preprocessor's scale_resolution); multiple of patch*4 = 56
    patch_size=14,
    n_embd=96, n_head=3, n_ff=256, n_layer=4,
    insert_layer=1,        # ViT merger runs after layer 1 (layers 0-1 on all patches, 2-3 on 1/4)
    scale_factor=4,        # 16x token reduction ("16x" downsample_mode); 2 would skip the ViT merger
    ds_ff=384,             # ViT merger downsample MLP: 4*W -> ds_ff -> W
    mm_ff=256,             # final merger: 4*W -> mm_ff -> n_embd_text
    n_embd_text=128,
    eps=1e-6,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    n_pos=70 * 70,
    res_gain=0.5,          # std gain of every residual branch (attn_out, ffn_down)
    wtype="F32",
)

# The vision tower at MiniCPM-V 4.6's scale (SigLIP-400M: 27 layers of 1152, 16 heads, FFN 4304,
# patch 14, slice size 448; F16 matrices as converted mmproj files hold them) for benchmarks
# (tools/bench_vision.sh); its output width stays the fixture text towers' 128, so it pairs with
# models/rand-qwen35-vl.gguf. About 0.8 GB, never committed.
MMPROJ_BENCH_SPEC = dict(MMPROJ_SPEC, seed=4610, image_size=448, n_embd=1152, n_head=16, n_ff=4304,
                         n_layer=27, insert_layer=6, ds_ff=4608, mm_ff=4608, wtype="F16")


def build_mmproj(out: str, seed: int | None = None, bench: bool = False):
    sp = MMPROJ_BENCH_SPEC if bench else MMPROJ_SPEC
    WT = F16 if sp["wtype"] == "F16" else F32
    seed = sp["seed"] if seed is None else seed
    W, H, FF, L = sp["n_embd"], sp["n_head"], sp["n_ff"], sp["n_layer"]
    P, D, DS, MM = sp["patch_size"], sp["n_embd_text"], sp["ds_ff"], sp["mm_ff"]
    assert FF != W, "clip.cpp swaps ffn_up/ffn_down of minicpmv layers when ffn_down has ne[0] == n_embd"
    assert sp["image_size"] % (P * sp["scale_factor"]) == 0
    sw = StreamWriter(out, "clip")
    sw.s("general.type", "mmproj")
    sw.s("general.name", "rand-minicpmv-mmproj-bench" if bench else "rand-minicpmv-mmproj")
    sw.s("general.description",
         f"LES random MiniCPM-V 4.6-style mmproj (minicpmv4_6), tools/make_vlm.py mmproj --seed {seed}")
    sw.u32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16 if WT == F16 else gguf.LlamaFileType.ALL_F32))
    sw.s("clip.projector_type", "minicpmv4_6")
    sw.kv("clip.has_vision_encoder", True, gguf.GGUFValueType.BOOL)
    sw.kv("clip.use_gelu", True, gguf.GGUFValueType.BOOL)
    sw.u32("clip.vision.image_size", sp["image_size"])
    sw.u32("clip.vision.patch_size", P)
    sw.u32("clip.vision.embedding_length", W)
    sw.u32("clip.vision.feed_forward_length", FF)
    sw.u32("clip.vision.block_count", L)
    sw.u32("clip.vision.projection_dim", D)
    sw.u32("clip.vision.attention.head_count", H)
    sw.f32("clip.vision.attention.layer_norm_epsilon", sp["eps"])
    sw.kv("clip.vision.image_mean", sp["image_mean"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    sw.kv("clip.vision.image_std", sp["image_std"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    sw.u32("clip.vision.projector.scale_factor", sp["scale_factor"])
    sw.kv("clip.vision.wa_layer_indexes", [sp["insert_layer"]], gguf.GGUFValueType.ARRAY,
          gguf.GGUFValueType.INT32)

    rnd = random_tensors(sw, seed)
    g = sp["res_gain"]

    def ln(name, n):
        rnd(name + ".weight", F32, (n,), 0, "norm")
        rnd(name + ".bias", F32, (n,), 0.05)

    def lin(name, n_in, n_out, std, bias_std=0.05):
        rnd(name + ".weight", WT, (n_in, n_out), std)
        rnd(name + ".bias", F32, (n_out,), bias_std)

    # conv kernel, ggml ne = [KW, KH, C_in, C_out]; the normalized pixels have std ~0.5-0.6
    rnd("v.patch_embd.weight", WT, (P, P, 3, W), 1.5 / math.sqrt(3 * P * P))
    rnd("v.patch_embd.bias", F32, (W,), 0.1)
    rnd("v.position_embd.weight", F16, (W, sp["n_pos"]), 0.5)
    for il in range(L):
        p = f"v.blk.{il}."
        ln(p + "ln1", W)
        lin(p + "attn_q", W, W, 1 / math.sqrt(W))
        lin(p + "attn_k", W, W, 1 / math.sqrt(W))
        lin(p + "attn_v", W, W, 1 / math.sqrt(W))
        lin(p + "attn_out", W, W, g / math.sqrt(W))
        ln(p + "ln2", W)
        lin(p + "ffn_up", W, FF, 1 / math.sqrt(W))
        lin(p + "ffn_down", FF, W, g / math.sqrt(FF))
    ln("v.post_ln", W)
    # ViT merger: window attention (pre-LN, residual) then 2x2 downsample MLP (+ mean of the 4)
    ln("v.vit_merger.ln1", W)
    lin("v.vit_merger.attn_q", W, W, 1 / math.sqrt(W))
    lin("v.vit_merger.attn_k", W, W, 1 / math.sqrt(W))
    lin("v.vit_merger.attn_v", W, W, 1 / math.sqrt(W))
    lin("v.vit_merger.attn_out", W, W, g / math.sqrt(W))
    ln("v.vit_merger.ds_ln", 4 * W)
    lin("v.vit_merger.ds_ffn_up", 4 * W, DS, 1 / math.sqrt(4 * W))
    lin("v.vit_merger.ds_ffn_down", DS, W, g / math.sqrt(DS))
    # final merger (DownsampleMLP): 2x2 concat -> LayerNorm -> up -> GELU(erf) -> down
    rnd("mm.input_norm.weight", F32, (4 * W,), 0, "norm")
    rnd("mm.input_norm.bias", F32, (4 * W,), 0.05)
    lin("mm.up", 4 * W, MM, 1 / math.sqrt(4 * W))
    lin("mm.down", MM, D, 1.0 / math.sqrt(MM))
    sw.write()


# ----------------------------------------------------------------------------------------------
# text towers (qwen35 dense, qwen35moe)
# ----------------------------------------------------------------------------------------------

VOCAB_BASE = 4096
MARKER_TOKENS = ["<image>", "</image>", "<slice>", "</slice>"]
SMOL_MERGE_OFFSET = 252  # SmolLM2: token id of merge i's result = i + 252
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")

# ssm_a = -A with A ~ U(0.1, 2) (the HF initialisation draws A in (0, 16)): a slow enough decay that the
# Gated DeltaNet layers still carry the image after the prompt's trailing text, so that the greedy
# output depends on the image from its first tokens (with A up to 16 it did not for the MoE).
TEXT_SPECS = {
    "qwen35": dict(
        arch="qwen35", seed=4601, logit_std=6.0, res_gain=4.0,
        n_embd=128, n_layer=4, interval=2, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
        sections=[3, 3, 2, 0], d_state=64, n_group=2, dt_rank=4, d_conv=4, n_ff=384, ssm_a_range=(-2.0, -0.1),
        rope_base=10000000.0, eps=1e-6, tied=True, embd_type=F16, out_type=None,
        # per layer: (attn_qkv | attn_q, attn_gate | attn_k, ssm_out | attn_v, ssm_beta/alpha | attn_output)
        mix_types=[(F32, F16, F16, F32), (F16, F32, F32, F16), (F32, F32, F16, F16), (F16, F32, F16, F32)],
        ffn_types=[(F16, F16, F32), (F32, F32, F16), (F16, F32, F16), (F32, F16, F32)],
    ),
    "qwen35moe": dict(
        arch="qwen35moe", seed=4602, logit_std=6.0, res_gain=4.0,
        n_embd=128, n_layer=4, interval=4, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
        sections=[3, 3, 2, 0], d_state=64, n_group=2, dt_rank=4, d_conv=4, ssm_a_range=(-2.0, -0.1),
        n_expert=8, top_k=2, n_ff_exp=64, n_ff_shexp=128,
        rope_base=10000000.0, eps=1e-6, tied=False, embd_type=F16, out_type=F16,
        mix_types=[(F32, F16, F16, F32), (F16, F32, F32, F16), (F32, F32, F16, F16), (F16, F32, F16, F32)],
        exp_types=[(F16, F16, F32), (F32, F32, F16), (F16, F32, F16), (F32, F16, F32)],
        shexp_types=[(F32, F32, F16), (F16, F16, F16), (F32, F16, F32), (F16, F32, F32)],
    ),
}


def write_vl_tokenizer(sw: StreamWriter, r: gguf.GGUFReader):
    """SmolLM2's first VOCAB_BASE tokens + merges producing them, the marker tokens (control), qwen2
    pre-tokenizer, no BOS, EOS = <|im_end|>, ChatML template. Returns n_vocab."""
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    for i, m in enumerate(merges[:VOCAB_BASE - SMOL_MERGE_OFFSET]):
        assert "".join(m.split(" ")) == toks[i + SMOL_MERGE_OFFSET], (i, m)
    assert not set(MARKER_TOKENS) & set(toks)
    new_toks = toks[:VOCAB_BASE] + MARKER_TOKENS
    new_types = types[:VOCAB_BASE] + [int(gguf.TokenType.CONTROL)] * len(MARKER_TOKENS)
    A, S, I32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32
    sw.s("tokenizer.ggml.model", "gpt2")
    sw.s("tokenizer.ggml.pre", "qwen2")
    sw.kv("tokenizer.ggml.tokens", new_toks, A, S)
    sw.kv("tokenizer.ggml.token_type", new_types, A, I32)
    sw.kv("tokenizer.ggml.merges", merges[:VOCAB_BASE - SMOL_MERGE_OFFSET], A, S)
    sw.u32("tokenizer.ggml.bos_token_id", toks.index("<|im_start|>"))
    sw.u32("tokenizer.ggml.eos_token_id", toks.index("<|im_end|>"))
    sw.u32("tokenizer.ggml.unknown_token_id", 0)
    sw.u32("tokenizer.ggml.padding_token_id", toks.index("<|im_end|>"))
    sw.kv("tokenizer.ggml.add_bos_token", False, gguf.GGUFValueType.BOOL)
    sw.kv("tokenizer.ggml.add_space_prefix", False, gguf.GGUFValueType.BOOL)
    sw.s("tokenizer.chat_template", CHATML)
    return len(new_toks)


def build_text(arch_key: str, src: str, out: str, seed: int | None = None):
    sp = TEXT_SPECS[arch_key]
    arch = sp["arch"]
    seed = sp["seed"] if seed is None else seed
    r = gguf.GGUFReader(src)
    D, L = sp["n_embd"], sp["n_layer"]
    H, HKV, HD = sp["n_head"], sp["n_head_kv"], sp["head_dim"]
    S, HK, HV, KC = sp["d_state"], sp["n_group"], sp["dt_rank"], sp["d_conv"]
    DI = S * HV
    CD = 2 * HK * S + DI
    moe = arch == "qwen35moe"
    sw = StreamWriter(out, arch)
    sw.s("general.type", "model")
    sw.s("general.name", f"rand-{arch_key}-vl")
    sw.s("general.description",
         f"LES random {arch} text tower for MiniCPM-V 4.6-style VLM tests, tools/make_vlm.py text "
         f"--arch {arch_key} --seed {seed}")
    sw.u32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16))  # nominal: F32/F16 mixed
    u32 = lambda keys: [sw.u32(f"{arch}.{key}", v) for key, v in keys]  # noqa: E731
    u32([("context_length", 4096), ("embedding_length", D), ("block_count", L)])
    if moe:
        FF, SF, E, K = sp["n_ff_exp"], sp["n_ff_shexp"], sp["n_expert"], sp["top_k"]
        u32([("feed_forward_length", 3 * FF), ("expert_feed_forward_length", FF),
             ("expert_shared_feed_forward_length", SF), ("expert_count", E), ("expert_used_count", K)])
    else:
        u32([("feed_forward_length", sp["n_ff"])])
    u32([("attention.head_count", H), ("attention.head_count_kv", HKV), ("attention.key_length", HD),
         ("attention.value_length", HD), ("rope.dimension_count", sp["n_rot"])])
    sw.kv(f"{arch}.rope.dimension_sections", sp["sections"], gguf.GGUFValueType.ARRAY,
          sub_type=gguf.GGUFValueType.INT32)
    sw.f32(f"{arch}.rope.freq_base", sp["rope_base"])
    sw.f32(f"{arch}.attention.layer_norm_rms_epsilon", sp["eps"])
    u32([("ssm.conv_kernel", KC), ("ssm.state_size", S), ("ssm.group_count", HK),
         ("ssm.time_step_rank", HV), ("ssm.inner_size", DI), ("full_attention_interval", sp["interval"])])
    n_vocab = write_vl_tokenizer(sw, r)
    rnd = random_tensors(sw, seed)
    gain = sp["res_gain"]
    rnd("token_embd.weight", sp["embd_type"], (D, n_vocab), sp["logit_std"] / math.sqrt(D) if sp["tied"] else 1.0)
    for il in range(L):
        p = f"blk.{il}."
        t0, t1, t2, t3 = sp["mix_types"][il % len(sp["mix_types"])]
        rnd(p + "attn_norm.weight", F32, (D,), 0, "norm")
        rnd(p + "post_attention_norm.weight", F32, (D,), 0, "norm")
        if (il + 1) % sp["interval"] != 0:  # Gated DeltaNet layer
            rnd(p + "attn_qkv.weight", t0, (D, CD), 1 / math.sqrt(D))
            rnd(p + "attn_gate.weight", t1, (D, DI), 1 / math.sqrt(D))
            rnd(p + "ssm_conv1d.weight", F32, (KC, CD), 0.5)
            rnd(p + "ssm_dt.bias", F32, (HV,), 0.5)
            rnd(p + "ssm_a", F32, (HV,), 0, "norm", *sp["ssm_a_range"])
            rnd(p + "ssm_beta.weight", t3, (D, HV), 1 / math.sqrt(D))
            rnd(p + "ssm_alpha.weight", t3, (D, HV), 1 / math.sqrt(D))
            rnd(p + "ssm_norm.weight", F32, (S,), 0, "norm")
            rnd(p + "ssm_out.weight", t2, (DI, D), gain / math.sqrt(DI))
        else:  # gated full attention
            rnd(p + "attn_q.weight", t0, (D, 2 * H * HD), 1 / math.sqrt(D))
            rnd(p + "attn_k.weight", t1, (D, HKV * HD), 1 / math.sqrt(D))
            rnd(p + "attn_v.weight", t2, (D, HKV * HD), 1 / math.sqrt(D))
            rnd(p + "attn_q_norm.weight", F32, (HD,), 0, "norm")
            rnd(p + "attn_k_norm.weight", F32, (HD,), 0, "norm")
            rnd(p + "attn_output.weight", t3, (H * HD, D), gain / math.sqrt(H * HD))
        if moe:
            ni = len(sp["exp_types"])
            moe_tensors(rnd, p, D, sp["n_expert"], sp["n_ff_exp"], gain, sp["exp_types"][il % ni],
                        (sp["n_ff_shexp"], sp["shexp_types"][il % ni]))
        else:
            tg, tu, td = sp["ffn_types"][il % len(sp["ffn_types"])]
            rnd(p + "ffn_gate.weight", tg, (D, sp["n_ff"]), 1 / math.sqrt(D))
            rnd(p + "ffn_up.weight", tu, (D, sp["n_ff"]), 1 / math.sqrt(D))
            rnd(p + "ffn_down.weight", td, (sp["n_ff"], D), gain / math.sqrt(sp["n_ff"]))
    rnd("output_norm.weight", F32, (D,), 0, "norm")
    if not sp["tied"]:
        rnd("output.weight", sp["out_type"], (D, n_vocab), sp["logit_std"] / math.sqrt(D))
    sw.write()


# ----------------------------------------------------------------------------------------------
# test images
# ----------------------------------------------------------------------------------------------

def pattern(w: int, h: int, seed: int, alpha: bool = False) -> np.ndarray:
    """Smooth deterministic picture (gradients, discs, stripes; no per-pixel noise, so PNGs stay
    small): uint8 (h, w, 3 or 4)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    u, v = x / max(w - 1, 1), y / max(h - 1, 1)
    img = np.stack([255 * u, 255 * v, 255 * (1 - 0.5 * u - 0.5 * v)], -1)
    for _ in range(6):  # discs of flat colour
        cx, cy = rng.random() * w, rng.random() * h
        rad = (0.08 + 0.2 * rng.random()) * min(w, h)
        col = rng.integers(0, 256, 3).astype(np.float64)
        m = (x - cx) ** 2 + (y - cy) ** 2 <= rad * rad
        img[m] = col
    ang, per = rng.random() * math.pi, 6 + 10 * rng.random()  # one band of stripes
    band = (np.abs(v - 0.5) < 0.1) & (np.sin((x * math.cos(ang) + y * math.sin(ang)) * 2 * math.pi / per) > 0)
    img[band] = 255 - img[band]
    out = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    if alpha:
        a = np.clip(np.rint(255 * (0.25 + 0.75 * u)), 0, 255).astype(np.uint8)
        out = np.concatenate([out, a[..., None]], -1)
    return out


def png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


# name, (w, h), seed, format, what llama.cpp does with it (see refs.json for the exact layout)
IMAGES = [
    ("square_224.png", (224, 224), 11, "png", "fits: overview only, no resize (224x224 = slice size)"),
    ("wide_200x150_rgba.png", (200, 150), 12, "png-rgba",
     "fits: overview only, stretched (bicubic) to 224x224; alpha dropped by stb_image"),
    ("slice_400x240.jpg", (400, 240), 13, "jpeg", "sliced: overview 280x168 + 2x1 grid of 224x224"),
    ("grid_336x700.png", (336, 700), 14, "png", "sliced: overview + 2 cols x 3 rows grid"),
]
BAD_IMAGES = ["bad_truncated.png", "bad_empty.png", "bad_zero_dims.png", "bad_garbage.jpg"]


def build_images(d: str):
    from PIL import Image
    out = Path(d)
    out.mkdir(parents=True, exist_ok=True)
    for name, (w, h), seed, fmt, _ in IMAGES:
        px = pattern(w, h, seed, alpha=(fmt == "png-rgba"))
        im = Image.fromarray(px, "RGBA" if px.shape[2] == 4 else "RGB")
        if fmt == "jpeg":
            im.save(out / name, "JPEG", quality=92, subsampling=0)  # 4:4:4: no chroma upsampling
        else:
            im.save(out / name, "PNG", optimize=True)
    # bad inputs
    good = (out / "square_224.png").read_bytes()
    (out / "bad_truncated.png").write_bytes(good[: len(good) * 2 // 5])
    (out / "bad_empty.png").write_bytes(b"")
    ihdr = struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)  # 0x0 RGB8 (invalid: PNG needs w, h >= 1)
    (out / "bad_zero_dims.png").write_bytes(
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"")) +
        png_chunk(b"IEND", b""))
    rng = np.random.Generator(np.random.PCG64(15))
    (out / "bad_garbage.jpg").write_bytes(b"\xff\xd8\xff\xe0" + rng.integers(0, 256, 1020, dtype=np.uint8).tobytes())
    for p in sorted(out.iterdir()):
        if p.suffix in (".png", ".jpg"):
            print(f"  {p} {p.stat().st_size} bytes", file=sys.stderr)


def write_png(path: Path, px: np.ndarray):
    """An RGB PNG without Pillow (filter 0 per row, zlib level 6)."""
    h, w, _ = px.shape
    raw = b"".join(b"\x00" + px[y].tobytes() for y in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(raw, 6)) +
                     png_chunk(b"IEND", b""))


# Benchmark images (tools/bench_vision.sh): one slice at MiniCPM-V's slice size, one sliced photo size.
BENCH_IMAGES = [("bench_448x448.png", (448, 448), 21), ("bench_1000x700.png", (1000, 700), 22)]


def build_bench_images(d: str):
    out = Path(d)
    out.mkdir(parents=True, exist_ok=True)
    for name, (w, h), seed in BENCH_IMAGES:
        write_png(out / name, pattern(w, h, seed))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("mmproj")
    s.add_argument("--out", default="models/rand-minicpmv-mmproj.gguf")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--bench", action="store_true", help="MiniCPM-V 4.6's tower size (F16, ~0.8 GB) for benchmarks")
    s = sub.add_parser("text")
    s.add_argument("--arch", required=True, choices=sorted(TEXT_SPECS))
    s.add_argument("--src", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    s.add_argument("--out", default=None)
    s.add_argument("--seed", type=int, default=None)
    s = sub.add_parser("images")
    s.add_argument("--dir", default="tests/data/vision")
    s = sub.add_parser("bench-images")
    s.add_argument("--dir", default="target/bench-vision")
    s = sub.add_parser("all")
    s.add_argument("--src", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    a = ap.parse_args()
    if a.cmd == "mmproj":
        build_mmproj(a.out, a.seed, a.bench)
    elif a.cmd == "text":
        build_text(a.arch, a.src, a.out or f"models/rand-{a.arch}-vl.gguf", a.seed)
    elif a.cmd == "images":
        build_images(a.dir)
    elif a.cmd == "bench-images":
        build_bench_images(a.dir)
    else:
        build_mmproj("models/rand-minicpmv-mmproj.gguf")
        for k in TEXT_SPECS:
            build_text(k, a.src, f"models/rand-{k}-vl.gguf")
        build_images("tests/data/vision")


if __name__ == "__main__":
    main()
