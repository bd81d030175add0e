//! `gpt-oss` (gpt-oss-20b / 120b; llama.cpp `src/models/openai-moe.cpp`, converter
//! `conversion/gpt_oss.py`): the [`super::llama`] decoder with
//! - Q/K/V and output biases (`attn_{q,k,v,output}.bias`) and attention sinks
//!   (`attn_sinks.weight`, one logit per head joining the softmax's denominator),
//! - sliding-window attention (`attention.sliding_window`, 128 in gpt-oss-20b) on every other
//!   layer (`il % 2 == 0`), full causal attention on the others,
//! - NEOX RoPE with YaRN (`rope.scaling.type` yarn, factor 32 over 4096 positions),
//! - the FFN norm named `post_attention_norm`,
//! - a biased router (`ffn_gate_inp.bias`): top-k of the raw logits, softmax over those k
//!   (`LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT`),
//! - MXFP4 experts with per-expert biases (`ffn_{gate,up,down}_exps.bias`) and the clamped
//!   `swiglu_oai` activation (alpha 1.702, limit 7),
//! - and no tied output (`output.weight` is required).
//!
//! Where each of these lives: hyper-parameters in [`super::config`] (`n_swa`, `swa`, `yarn`,
//! `gating`, `expert_act`), tensors in [`super::blocks`] (`Attention`, `Moe`), ops in
//! [`crate::backend::ops`] (`Attn::window` / `sinks`, `Rope::yarn`, `ExpertFfn`).

use super::blocks::QkNorm;
use super::llama::Llama;
use super::{Config, Loader, ModelError};

pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Llama, ModelError> {
    if !ld.has("output.weight") {
        return Err(ModelError::Gguf(crate::gguf::GgufError::MissingTensor("output.weight".into())));
    }
    let l = Llama::load_named(ld, c, QkNorm::None, ("post_attention_norm", "attn_post_norm"))?;
    for (il, layer) in l.layers.iter().enumerate() {
        if layer.attn.sinks.is_none() {
            return Err(ModelError::Gguf(crate::gguf::GgufError::MissingTensor(format!("blk.{il}.attn_sinks.weight"))));
        }
    }
    Ok(l)
}
