//! `lfm2moe` (LFM2-8B-A1B, LFM2.5-8B-A1B, LFM2-24B-A2B; llama.cpp `src/models/lfm2.cpp` graph,
//! `src/models/lfm2moe.cpp` tensors, converter `conversion/lfm2.py` `LFM2MoeModel`): a hybrid of
//! short-convolution layers and GQA layers (`attention.head_count_kv` 0 marks a conv layer).
//!
//! Per layer: RMSNorm (`attn_norm`, llama.cpp's `operator_norm`) → short convolution or attention
//! → residual → RMSNorm (`ffn_norm`) → dense SwiGLU (the first `leading_dense_block_count` layers)
//! or routed SwiGLU experts → residual. Then RMSNorm (`token_embd_norm`: the GGUF's name for the
//! output norm) and the output (tied to the embeddings when `output.weight` is absent).
//!
//! - Short convolution: `[b | c | x] = in_proj · h` (one matrix of 3 · n_embd rows, read here as
//!   three), `bx = b ⊙ x`, a causal depthwise conv1d of length L (`shortconv.l_cache`) over `bx`
//!   from the layer's conv state (the last L − 1 inputs; ggml `ssm_conv`, no activation),
//!   `y = c ⊙ conv`, `out_proj · y`.
//! - Attention: per-head RMS QK-norm (`attn_q_norm` / `attn_k_norm`), NEOX RoPE, GQA.
//! - Router: `sigmoid(ffn_gate_inp · h)`; the top-k chosen on the probabilities plus the selection
//!   bias `exp_probs_b.bias`, weighted by the unbiased ones, normalised (`build_moe_ffn`).

use super::blocks::{Attention, Ffn, Fwd, QkNorm};
use super::{Config, Loader, ModelError};
use crate::backend::ops::{Mat, Ops, Vector};

/// A short-convolution layer's weights.
pub struct ShortConv {
    /// `in_proj`'s three parts: the input gate `b`, the output gate `c`, the input `x`.
    pub b: Mat,
    pub c: Mat,
    pub x: Mat,
    /// `shortconv.conv.weight`: L values per channel.
    pub conv: Vector,
    pub out: Mat,
}

pub enum Mixer {
    Conv(ShortConv),
    Attn(Attention),
}

pub struct Layer {
    pub attn_norm: Vector,
    pub mixer: Mixer,
    pub ffn_norm: Vector,
    pub ffn: Ffn,
}

pub struct Lfm2Moe {
    pub layers: Vec<Layer>,
    l_cache: usize,
}

impl Lfm2Moe {
    pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Self, ModelError> {
        let l_cache = c.shortconv.ok_or_else(|| ModelError::Internal("lfm2moe without shortconv.l_cache".into()))?;
        let e = c.n_embd;
        let mut layers = Vec::with_capacity(c.n_layer);
        for il in 0..c.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            let mixer = if c.is_recurrent(il) {
                let p = ld.mat_parts(&n("shortconv.in_proj.weight"), [e, 3 * e], &[vec![0..e], vec![e..2 * e], vec![2 * e..3 * e]])?;
                Mixer::Conv(ShortConv {
                    b: p[0],
                    c: p[1],
                    x: p[2],
                    conv: ld.vec_shaped(&n("shortconv.conv.weight"), &[l_cache, e])?,
                    out: ld.mat(&n("shortconv.out_proj.weight"), [e, e])?,
                })
            } else {
                Mixer::Attn(Attention::load(ld, c, il, QkNorm::PerHead)?)
            };
            layers.push(Layer { attn_norm: ld.vec(&n("attn_norm.weight"), e)?, mixer, ffn_norm: ld.vec(&n("ffn_norm.weight"), e)?, ffn: Ffn::load(ld, c, il)? });
        }
        Ok(Self { layers, l_cache })
    }

    pub async fn forward<B: Ops>(&self, f: &mut Fwd<'_, B>) -> Result<Vec<f32>, ModelError> {
        let mut x = f.embed().await?;
        for (il, l) in self.layers.iter().enumerate() {
            let cur = f.norm(&x, l.attn_norm, "attn_norm", il).await?;
            let mix = match &l.mixer {
                Mixer::Conv(sc) => self.short_conv(f, il, &cur, sc).await?,
                Mixer::Attn(a) => f.attention(il, &cur, a).await?,
            };
            x = f.attn_residual(il, x, mix).await?;
            let cur = f.norm(&x, l.ffn_norm, "ffn_norm", il).await?;
            let out = match &l.ffn {
                Ffn::Dense(w) => f.ffn(il, &cur, w).await?,
                Ffn::Moe(w) => f.moe(il, &cur, &x, w).await?,
            };
            f.layer_out(il, &mut x, out).await?;
        }
        f.output(x).await
    }

    /// The short convolution of `cur` (llama.cpp `build_shortconv_block`).
    async fn short_conv<B: Ops>(&self, f: &mut Fwd<'_, B>, il: usize, cur: &B::T, sc: &ShortConv) -> Result<B::T, ModelError> {
        let [mut bx, mut y, xx] = f.matmuls(cur, [sc.b, sc.c, sc.x])?;
        f.b.mul(&mut bx, &xx)?;
        let conv = f.b.ssm_conv(il, &bx, sc.conv, self.l_cache, false)?;
        f.dump("shortconv_conv", il, &conv).await?;
        f.b.mul(&mut y, &conv)?;
        let [out] = f.matmuls(&y, [sc.out])?;
        f.dump("shortconv_out", il, &out).await?;
        Ok(out)
    }
}
