//! `qwen3moe` (llama.cpp `src/models/qwen3moe.cpp`): the [`super::llama`] decoder with an RMS
//! QK-norm per head (`attn_q_norm` / `attn_k_norm` of `head_dim` values) before RoPE, top-k
//! weights renormalised to sum to 1, NEOX RoPE.

use super::blocks::QkNorm;
use super::llama::Llama;
use super::{Config, Loader, ModelError};

pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Llama, ModelError> {
    Llama::load_with(ld, c, QkNorm::PerHead)
}
