//! Hyper-parameters from GGUF metadata, with llama.cpp's key names (`src/llama-arch.cpp`) and
//! per-architecture choices (`src/llama-model.cpp`, `src/models/<arch>.cpp`).

use crate::backend::cpu::ops::RopeKind;
use crate::gguf::{GgufError, GgufFile};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `llama`: dense, or Mixtral-style MoE when `llama.expert_count` > 0.
    Llama,
    /// `qwen2moe`: Q/K/V biases, a sigmoid-gated shared expert, un-normalised top-k weights.
    Qwen2Moe,
    /// `qwen3moe`: per-head RMS QK-norm, normalised top-k weights.
    Qwen3Moe,
    /// `olmoe`: RMS QK-norm over the whole Q / K vectors, un-normalised top-k weights.
    Olmoe,
}

impl Arch {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "llama" => Arch::Llama,
            "qwen2moe" => Arch::Qwen2Moe,
            "qwen3moe" => Arch::Qwen3Moe,
            "olmoe" => Arch::Olmoe,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Olmoe => "olmoe",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    /// Dense FFN width (`feed_forward_length`).
    pub n_ff: usize,
    /// Experts per MoE layer (`n_expert`; 0 for dense models).
    pub n_expert: usize,
    /// Experts used per token (`n_expert_used`, the top-k).
    pub n_expert_used: usize,
    /// Width of one expert's FFN (`expert_feed_forward_length`, else `n_ff`).
    pub n_ff_exp: usize,
    /// Width of the shared expert (`expert_shared_feed_forward_length`; 0 when none).
    pub n_ff_shexp: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope: RopeKind,
    /// Renormalise the selected top-k weights to sum to 1 (llama/Mixtral, qwen3moe).
    pub norm_topk: bool,
    /// `expert_weights_scale` (0 or 1 = none).
    pub expert_weights_scale: f32,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture '{0}' (LES runs llama, qwen2moe, qwen3moe, olmoe)")]
    UnsupportedArch(String),
    #[error("invalid hyper-parameter {key} = {value}: {why}")]
    Invalid { key: String, value: u64, why: &'static str },
}

impl Config {
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ConfigError> {
        let a = g.architecture()?.to_string();
        let arch = Arch::parse(&a).ok_or_else(|| ConfigError::UnsupportedArch(a.clone()))?;
        let k = |s: &str| format!("{a}.{s}");
        let req = |s: &str| -> Result<usize, ConfigError> { Ok(g.req_u64(&k(s))? as usize) };
        let opt = |s: &str| g.get_u64(&k(s)).map(|v| v as usize);
        let n_embd = req("embedding_length")?;
        let n_layer = req("block_count")?;
        let n_head = req("attention.head_count")?;
        let n_head_kv = opt("attention.head_count_kv").unwrap_or(n_head);
        let check = |key: &str, v: usize, ok: bool, why: &'static str| -> Result<(), ConfigError> {
            if ok { Ok(()) } else { Err(ConfigError::Invalid { key: k(key), value: v as u64, why }) }
        };
        check("embedding_length", n_embd, n_embd > 0 && n_embd <= 1 << 16, "must be in 1..=65536")?;
        check("block_count", n_layer, n_layer > 0 && n_layer <= 1024, "must be in 1..=1024")?;
        check("attention.head_count", n_head, n_head > 0 && n_head <= 1024, "must be in 1..=1024")?;
        check("attention.head_count_kv", n_head_kv, n_head_kv > 0 && n_head % n_head_kv == 0, "must divide head_count")?;
        let head_dim = opt("attention.key_length").unwrap_or(n_embd / n_head);
        check("attention.key_length", head_dim, head_dim > 0 && head_dim % 2 == 0 && head_dim <= 1024, "must be even, ≤ 1024")?;
        let n_rot = opt("rope.dimension_count").unwrap_or(head_dim);
        check("rope.dimension_count", n_rot, n_rot <= head_dim && n_rot % 2 == 0, "must be even and ≤ head dim")?;
        let n_expert = opt("expert_count").unwrap_or(0);
        let n_expert_used = opt("expert_used_count").unwrap_or(0);
        check("expert_used_count", n_expert_used, n_expert == 0 || (n_expert_used > 0 && n_expert_used <= n_expert), "must be in 1..=expert_count")?;
        check("expert_count", n_expert, n_expert <= 4096, "must be ≤ 4096")?;
        let n_ff = opt("feed_forward_length").unwrap_or(0);
        let n_ff_exp = opt("expert_feed_forward_length").unwrap_or(n_ff);
        let n_ff_shexp = opt("expert_shared_feed_forward_length").unwrap_or(0);
        let n_vocab = opt("vocab_size")
            .or_else(|| g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(|a| a.len()))
            .unwrap_or(0);
        let rope = match arch {
            Arch::Llama => RopeKind::Norm,
            _ => RopeKind::Neox,
        };
        Ok(Config {
            arch,
            n_vocab,
            n_ctx_train: opt("context_length").unwrap_or(2048),
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_ff,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            rms_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            rope_base: g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0),
            rope,
            norm_topk: matches!(arch, Arch::Llama | Arch::Qwen3Moe),
            expert_weights_scale: g.get_f32(&k("expert_weights_scale")).unwrap_or(0.0),
        })
    }

    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }
    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}
