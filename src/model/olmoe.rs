//! `olmoe` (llama.cpp `src/models/olmoe.cpp`): the [`super::llama`] decoder with an RMS QK-norm
//! over the whole Q and K rows (`attn_q_norm` of `n_embd_q`, `attn_k_norm` of `n_embd_kv`
//! values), top-k weights not renormalised, NEOX RoPE.

use super::blocks::QkNorm;
use super::llama::Llama;
use super::{Config, Loader, ModelError};

pub fn load(ld: &mut Loader<'_>, c: &Config) -> Result<Llama, ModelError> {
    Llama::load_with(ld, c, QkNorm::Whole)
}
