//! `smallthinker` (SmallThinker-21B-A3B, SmallThinker-4B-A0.6B; llama.cpp
//! `src/models/smallthinker.cpp`, converter `conversion/smallthinker.py`; arXiv 2507.20984): the
//! [`super::llama`] decoder's tensors with
//! - the router on the layer's input, before attention: `ffn_gate_inp × inpL`, with no norm
//!   (llama.cpp computes `ffn_moe_logits` first and hands them to `build_moe_ffn` as `probs_in`);
//! - sigmoid or softmax gating (`expert_gating_func`), the top-k weights normalised;
//! - ReGLU experts (`LLM_FFN_RELU` with a gate: `relu(gate) · up`);
//! - with a sliding window in the file: windows of 4096 on the layers with `il % 4 != 0`, and no
//!   RoPE on the others (NoPE global layers); without one, RoPE everywhere ([`super::config`]).
//!
//! Because the router runs first, a layer's experts are known before its attention: the expert
//! source hears them at once ([`crate::expert::ExpertSource::on_route`]) and a streaming cache
//! reads the misses while attention computes — exact lookahead, where other architectures have
//! only predictions.

use super::blocks::{Ffn, Fwd, QkNorm, Routing};
use super::llama::Llama;
use super::{Config, Loader, ModelError};
use crate::backend::ops::Ops;

pub struct SmallThinker {
    pub dec: Llama,
}

impl SmallThinker {
    pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Self, ModelError> {
        Ok(Self { dec: Llama::load_with(ld, c, QkNorm::None)? })
    }

    pub async fn forward<B: Ops>(&self, f: &mut Fwd<'_, B>) -> Result<Vec<f32>, ModelError> {
        let mut x = f.embed().await?;
        for (il, l) in self.dec.layers.iter().enumerate() {
            let Ffn::Moe(w) = &l.ffn else {
                return Err(ModelError::Internal(format!("smallthinker layer {il} has no router")));
            };
            // The router on the layer's input (`probs = ffn_gate_inp × inpL`); in the last layer
            // only the rows that go on (llama.cpp's `get_rows(probs, inp_out_ids)`).
            let mut logits = f.router_logits(&x, w)?;
            if f.trims(il, Fwd::<B>::rows(&x)) {
                logits = f.b.last_row(logits)?;
            }
            let routing = f.route(il, logits, &x, w).await?;
            if let (Routing::Host { sel, .. }, Some(src)) = (&routing, &f.experts) {
                let mut ids: Vec<u32> = Vec::with_capacity(sel.len());
                for &e in sel {
                    if !ids.contains(&e) {
                        ids.push(e);
                    }
                }
                src.on_route(f.m.cfg.expert_layer(il), &ids, Fwd::<B>::rows(&x));
            }
            let cur = f.norm(&x, l.attn_norm, "attn_norm", il).await?;
            let attn = f.attention(il, &cur, &l.attn).await?;
            x = f.attn_residual(il, x, attn).await?;
            let cur = f.norm(&x, l.ffn_norm, "ffn_norm", il).await?;
            let out = f.moe_routed(il, &cur, &x, w, routing).await?;
            f.layer_out(il, &mut x, out).await?;
        }
        f.output(x).await
    }
}
