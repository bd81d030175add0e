//! RoPE's variants and YaRN's parameters, shared by the op contract ([`super::ops::Rope`]) and
//! every backend's kernels (the CPU's cos/sin table, `crate::backend::cpu::ops::rope_cache_ext`,
//! is what the GPU uploads too).

/// RoPE variants (llama.cpp `llama_rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// Rotate adjacent pairs (x[2i], x[2i+1]) (`LLAMA_ROPE_TYPE_NORM`: llama, mixtral).
    Norm,
    /// Rotate (x[i], x[i + n_rot/2]) (`LLAMA_ROPE_TYPE_NEOX`: qwen2moe, qwen3moe, olmoe).
    Neox,
}

/// YaRN context extension as llama.cpp passes it to ggml `rope_ext` (`src/llama-context.cpp`:
/// `freq_scale = 1 / rope.scaling.factor`, `ext_factor = 1`, `attn_factor`; beta_fast 32, beta_slow
/// 1; `n_ctx_orig = rope.scaling.original_context_length`). The cos/sin table follows ggml-cpu's
/// `rope_yarn` ([`super::cpu::ops::rope_cache_ext`]); every backend takes it from the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub n_ctx_orig: usize,
}
