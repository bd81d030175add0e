//! `qwen2moe` (llama.cpp `src/models/qwen2moe.cpp`): the [`super::llama`] decoder with
//! - Q/K/V biases (`attn_{q,k,v}.bias`),
//! - a shared expert (`ffn_{gate,up,down}_shexp`, width `expert_shared_feed_forward_length`)
//!   added to the routed experts' output, scaled by `sigmoid(ffn_gate_inp_shexp · x)`,
//! - top-k weights not renormalised (`Config::norm_topk` false), NEOX RoPE.
//!
//! The biases and the shared expert are loaded where the file has them, as by every family of
//! the decoder ([`super::blocks::Attention::load`], [`super::blocks::Moe::load`]).

use super::blocks::QkNorm;
use super::llama::Llama;
use super::{Config, Loader, ModelError};

pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Llama, ModelError> {
    Llama::load_with(ld, c, QkNorm::None)
}
