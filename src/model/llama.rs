//! `llama`: the llama decoder, dense or with Mixtral-style MoE FFNs (llama.cpp
//! `src/models/llama.cpp`). It is also the decoder of the MoE families that differ from it only
//! in their tensors and hyper-parameters ([`super::qwen2moe`], [`super::qwen3moe`],
//! [`super::olmoe`]), as candle's `qwen3_moe.rs` reuses `qwen3.rs`.
//!
//! Per layer: RMSNorm → attention (GQA, RoPE, optional Q/K/V biases and QK-norm) → residual →
//! RMSNorm → FFN (SwiGLU, or router softmax → top-k → experts combined in rank order, plus an
//! optional shared expert) → residual. Then RMSNorm and the output projection.

use super::blocks::{Attention, Ffn, Fwd, QkNorm};
use super::{Config, Loader, ModelError};
use crate::backend::ops::{Ops, Vector};

pub struct Layer {
    pub attn_norm: Vector,
    pub attn: Attention,
    pub ffn_norm: Vector,
    pub ffn: Ffn,
}

pub struct Llama {
    pub layers: Vec<Layer>,
    /// The FFN norm's tensor and dump name (`ffn_norm`; gpt-oss: `post_attention_norm`, dumped
    /// as llama.cpp's `attn_post_norm`).
    ffn_norm: (&'static str, &'static str),
}

impl Llama {
    /// `llama` tensors: no QK-norm; `attn_{q,k,v}.bias` where present.
    pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Self, ModelError> {
        Self::load_with(ld, c, QkNorm::None)
    }

    /// The decoder's tensors with the given QK-norm (the families built on it choose theirs).
    pub fn load_with(ld: &mut Loader<'_>, c: &Config, qk: QkNorm) -> Result<Self, ModelError> {
        Self::load_named(ld, c, qk, ("ffn_norm", "ffn_norm"))
    }

    /// [`Self::load_with`] with the FFN norm under another name: (tensor stem, dump name).
    pub fn load_named(ld: &mut Loader<'_>, c: &Config, qk: QkNorm, ffn_norm: (&'static str, &'static str)) -> Result<Self, ModelError> {
        let mut layers = Vec::with_capacity(c.n_layer);
        for il in 0..c.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            layers.push(Layer {
                attn_norm: ld.vec(&n("attn_norm.weight"), c.n_embd)?,
                attn: Attention::load(ld, c, il, qk)?,
                ffn_norm: ld.vec(&n(&format!("{}.weight", ffn_norm.0)), c.n_embd)?,
                ffn: Ffn::load(ld, c, il)?,
            });
        }
        Ok(Self { layers, ffn_norm })
    }

    pub async fn forward<B: Ops>(&self, f: &mut Fwd<'_, B>) -> Result<Vec<f32>, ModelError> {
        let mut x = f.embed().await?;
        for (il, l) in self.layers.iter().enumerate() {
            let cur = f.norm(&x, l.attn_norm, "attn_norm", il).await?;
            let attn = f.attention(il, &cur, &l.attn).await?;
            x = f.attn_residual(il, x, attn).await?;
            let cur = f.norm(&x, l.ffn_norm, self.ffn_norm.1, il).await?;
            let out = match &l.ffn {
                Ffn::Dense(w) => f.ffn(il, &cur, w).await?,
                Ffn::Moe(w) => f.moe(il, &cur, &x, w).await?,
            };
            f.layer_out(il, &mut x, out).await?;
        }
        f.output(x).await
    }
}
