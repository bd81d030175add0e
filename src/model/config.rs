//! Hyper-parameters from GGUF metadata, with llama.cpp's key names (`src/llama-arch.cpp`) and
//! per-architecture choices (`src/llama-model.cpp`, `src/models/<arch>.cpp`).

use crate::backend::ops::{ExpertAct, RopeKind, Yarn};
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
    /// `qwen35moe` (Qwen3.5 / 3.6 MoE): Gated DeltaNet layers between gated full-attention
    /// layers, softmax top-k renormalised, a sigmoid-gated shared expert; IMROPE (= NEOX for text).
    Qwen35Moe,
    /// `qwen35` (Qwen3.5 dense, the text tower of MiniCPM-V 4.6): as `qwen35moe` with a dense
    /// SwiGLU FFN in every layer (llama.cpp `src/models/qwen35.cpp`).
    Qwen35,
    /// `qwen3next` (Qwen3-Next): as `qwen35moe` with a fused `ssm_ba` and grouped v→k heads.
    Qwen3Next,
    /// `gpt-oss` (llama.cpp `openai-moe.cpp`): biased attention with sinks, sliding-window layers,
    /// YaRN, a biased router (softmax over the top-k logits), biased MXFP4 experts, `swiglu_oai`.
    GptOss,
    /// `smallthinker` (SmallThinker-21B-A3B / 4B-A0.6B; llama.cpp `src/models/smallthinker.cpp`):
    /// the router reads the layer's input before attention, sigmoid or softmax gating
    /// (`expert_gating_func`), ReGLU experts, NoPE global layers between RoPE sliding-window ones.
    SmallThinker,
    /// `lfm2moe` (LFM2-8B-A1B, LFM2-24B-A2B; llama.cpp `src/models/lfm2.cpp`): short-convolution
    /// layers (gated causal conv1d, a conv state per layer) between GQA layers with a per-head
    /// QK-norm, dense SwiGLU in the first layers, then sigmoid routing with a selection bias
    /// (`exp_probs_b`) over SwiGLU experts.
    Lfm2Moe,
}

impl Arch {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "llama" => Arch::Llama,
            "qwen2moe" => Arch::Qwen2Moe,
            "qwen3moe" => Arch::Qwen3Moe,
            "olmoe" => Arch::Olmoe,
            "qwen35moe" => Arch::Qwen35Moe,
            "qwen35" => Arch::Qwen35,
            "qwen3next" => Arch::Qwen3Next,
            "gpt-oss" => Arch::GptOss,
            "smallthinker" => Arch::SmallThinker,
            "lfm2moe" => Arch::Lfm2Moe,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Olmoe => "olmoe",
            Arch::Qwen35Moe => "qwen35moe",
            Arch::Qwen35 => "qwen35",
            Arch::Qwen3Next => "qwen3next",
            Arch::GptOss => "gpt-oss",
            Arch::SmallThinker => "smallthinker",
            Arch::Lfm2Moe => "lfm2moe",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    /// Trunk layers (`block_count` less the multi-token-prediction blocks).
    pub n_layer: usize,
    /// Multi-token-prediction (NextN) blocks after the trunk (`nextn_predict_layers`; 0: none).
    /// They are loaded only for MTP drafting ([`crate::model::Model::load_mtp`]).
    pub n_nextn: usize,
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
    /// The linear-attention (Gated DeltaNet) shape of a hybrid model (`qwen35moe`, `qwen3next`).
    pub ssm: Option<Ssm>,
    /// Per layer: whether it is a recurrent (Gated DeltaNet) layer; all false for transformers.
    pub recurrent: Vec<bool>,
    /// Sliding-window size (`attention.sliding_window`; 0 = none) and the layers that use it
    /// (gpt-oss: `attention.sliding_window_pattern`, default 2: layer il when `il % 2 == 0`).
    pub n_swa: usize,
    pub swa: Vec<bool>,
    /// RoPE base of the sliding-window layers (`rope.freq_base_swa`, else `rope.freq_base`).
    pub rope_base_swa: f32,
    /// RoPE scaling (`rope.scaling.type` yarn or linear, `rope.scaling.factor`, …).
    pub yarn: Option<Yarn>,
    /// How router logits become expert weights.
    pub gating: Gating,
    /// The experts' gated activation.
    pub expert_act: ExpertAct,
    /// Per layer: whether its attention skips RoPE (NoPE; smallthinker's global layers).
    pub nope: Vec<bool>,
    /// lfm2's short convolution: the conv kernel's length L (`shortconv.l_cache`; its state
    /// keeps L − 1 inputs per channel). `None`: no such layers.
    pub shortconv: Option<usize>,
    /// The first layers with a dense FFN before the MoE ones (`leading_dense_block_count`).
    pub n_dense_lead: usize,
}

pub use crate::backend::ops::Gating;

/// How a Gated DeltaNet layer's value heads find their key heads (llama.cpp `qwen35moe.cpp` /
/// `qwen3next.cpp`; `../shared/research/moe_archs.md` §1.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadMap {
    /// v-head `h` uses k-head `h % n_group` (qwen35moe: the converter reorders the V heads).
    Tiled,
    /// v-head `h` uses k-head `h / (dt_rank / n_group)` (qwen3next: repeat-interleave).
    Grouped,
}

/// Gated DeltaNet hyper-parameters (`<arch>.ssm.*`), llama.cpp's names in brackets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ssm {
    /// Causal conv1d width (`ssm.conv_kernel`, `ssm_d_conv`).
    pub d_conv: usize,
    /// Key / value head size S (`ssm.state_size`, `ssm_d_state`).
    pub d_state: usize,
    /// Key heads H_k (`ssm.group_count`, `ssm_n_group`).
    pub n_group: usize,
    /// Value heads H_v (`ssm.time_step_rank`, `ssm_dt_rank`).
    pub dt_rank: usize,
    /// `H_v · S` (`ssm.inner_size`, `ssm_d_inner`).
    pub d_inner: usize,
    pub head_map: HeadMap,
}

impl Ssm {
    /// Conv channels: q, k (`H_k · S` each) and v (`H_v · S`).
    pub fn conv_dim(&self) -> usize {
        2 * self.n_group * self.d_state + self.d_inner
    }
    /// f32 values of one layer's conv state (`n_embd_r`: the last `d_conv − 1` inputs per channel).
    pub fn conv_state_len(&self) -> usize {
        (self.d_conv - 1) * self.conv_dim()
    }
    /// f32 values of one layer's delta-rule state (`n_embd_s`: an S×S matrix per value head).
    pub fn ssm_state_len(&self) -> usize {
        self.d_state * self.d_inner
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture '{0}' (LES runs llama, qwen2moe, qwen3moe, olmoe, qwen35moe, qwen35, qwen3next, gpt-oss, smallthinker, lfm2moe)")]
    UnsupportedArch(String),
    #[error("invalid hyper-parameter {key} = {value}: {why}")]
    Invalid { key: String, value: u64, why: &'static str },
    #[error("missing hyper-parameter {0}")]
    Missing(String),
    #[error("unsupported {key} = '{value}' (LES knows {known})")]
    UnsupportedValue { key: String, value: String, known: &'static str },
}

/// The block index of a layer tensor's name (`blk.N.…` → N).
pub fn tensor_block(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
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
        // `attention.head_count_kv` may be one value per layer (lfm2moe: 0 on the short-convolution
        // layers); the attention layers must then agree.
        let kv_per_layer: Option<Vec<usize>> = g.get(&k("attention.head_count_kv")).and_then(|v| v.as_array()).map(|a| a.iter().map(|v| v.as_u64().unwrap_or(u64::MAX).min(1 << 20) as usize).collect());
        let (n_head_kv, kv_ok) = match &kv_per_layer {
            Some(a) => {
                let nz: Vec<usize> = a.iter().copied().filter(|&v| v > 0).collect();
                let first = nz.first().copied().unwrap_or(0);
                (first, a.len() == n_layer && !nz.is_empty() && nz.iter().all(|&v| v == first))
            }
            None => (opt("attention.head_count_kv").unwrap_or(n_head), true),
        };
        let check = |key: &str, v: usize, ok: bool, why: &'static str| -> Result<(), ConfigError> {
            if ok { Ok(()) } else { Err(ConfigError::Invalid { key: k(key), value: v as u64, why }) }
        };
        check("attention.head_count_kv", n_head_kv, kv_ok, "per-layer values must have block_count entries, the non-zero ones equal")?;
        check("embedding_length", n_embd, n_embd > 0 && n_embd <= 1 << 16, "must be in 1..=65536")?;
        check("block_count", n_layer, n_layer > 0 && n_layer <= 1024, "must be in 1..=1024")?;
        // qwen35moe / qwen3next files may keep multi-token-prediction blocks after the trunk
        // (`nextn_predict_layers`, llama.cpp `n_layer() = block_count − nextn`); the trunk does not
        // run them (MTP drafting does: `Model::load_mtp`).
        let nextn = if matches!(arch, Arch::Qwen35Moe | Arch::Qwen35 | Arch::Qwen3Next) { opt("nextn_predict_layers").unwrap_or(0) } else { 0 };
        check("nextn_predict_layers", nextn, nextn < n_layer, "must be below block_count")?;
        let n_layer = n_layer - nextn;
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
        // The architectures whose graphs have no dense-FFN form.
        if matches!(arch, Arch::Qwen35Moe | Arch::Qwen3Next | Arch::GptOss | Arch::SmallThinker | Arch::Lfm2Moe) {
            check("expert_count", n_expert, n_expert > 0, "must be > 0 (this architecture is MoE only)")?;
        }
        let hybrid = matches!(arch, Arch::Qwen35Moe | Arch::Qwen35 | Arch::Qwen3Next);
        let (ssm, recurrent) = if arch == Arch::Lfm2Moe {
            let kv = kv_per_layer.clone().ok_or_else(|| ConfigError::Missing(format!("{} (one value per layer)", k("attention.head_count_kv"))))?;
            (None, kv.iter().map(|&v| v == 0).collect())
        } else if hybrid {
            if arch == Arch::Qwen35 {
                check("expert_count", n_expert, n_expert == 0, "must be 0 (qwen35 is dense; MoE files are qwen35moe)")?;
                check("feed_forward_length", n_ff, n_ff > 0 && n_ff <= 1 << 20, "must be in 1..=1048576")?;
            }
            let ssm_key = |s: &str| -> Result<usize, ConfigError> { opt(s).ok_or_else(|| ConfigError::Missing(k(s))) };
            let ssm = Ssm {
                d_conv: ssm_key("ssm.conv_kernel")?,
                d_state: ssm_key("ssm.state_size")?,
                n_group: ssm_key("ssm.group_count")?,
                dt_rank: ssm_key("ssm.time_step_rank")?,
                d_inner: ssm_key("ssm.inner_size")?,
                head_map: if arch == Arch::Qwen3Next { HeadMap::Grouped } else { HeadMap::Tiled },
            };
            check("ssm.conv_kernel", ssm.d_conv, (2..=64).contains(&ssm.d_conv), "must be in 2..=64")?;
            check("ssm.state_size", ssm.d_state, ssm.d_state > 0 && ssm.d_state <= 1024, "must be in 1..=1024")?;
            check("ssm.group_count", ssm.n_group, ssm.n_group > 0 && ssm.n_group <= 1024, "must be in 1..=1024")?;
            check("ssm.time_step_rank", ssm.dt_rank, ssm.dt_rank > 0 && ssm.dt_rank <= 1024 && ssm.dt_rank % ssm.n_group == 0, "must be in 1..=1024 and a multiple of ssm.group_count")?;
            check("ssm.inner_size", ssm.d_inner, ssm.d_inner == ssm.d_state * ssm.dt_rank, "must equal ssm.state_size × ssm.time_step_rank")?;
            // Bounded allocations: one sequence's recurrent state (f32, per linear layer) ≤ 1 GiB
            // per layer (Qwen3.5-35B-A3B: 2.1 MiB).
            let per_layer = (ssm.conv_state_len() + ssm.ssm_state_len()) as u64 * 4;
            check("ssm.state_size", ssm.d_state, per_layer <= 1 << 30, "the recurrent state per layer (conv + S × ssm.inner_size f32) exceeds 1 GiB")?;
            // llama.cpp: `attention.recurrent_layers` (bool per layer), else every
            // `full_attention_interval`-th layer (default 4) is full attention.
            let recurrent: Vec<bool> = match g.get(&k("attention.recurrent_layers")).and_then(|v| v.as_array()) {
                Some(a) => {
                    check("attention.recurrent_layers", a.len(), a.len() == n_layer || a.len() == n_layer + nextn, "must have block_count entries")?;
                    a.iter().take(n_layer).map(|v| v.as_u64().unwrap_or(0) != 0).collect()
                }
                None => {
                    let iv = opt("full_attention_interval").unwrap_or(4);
                    check("full_attention_interval", iv, iv > 0, "must be > 0")?;
                    (0..n_layer).map(|i| (i + 1) % iv != 0).collect()
                }
            };
            // Text positions only: IMROPE is NEOX when every rotated pair takes a t/h/w section
            // (ggml `ggml_mrope_cache_init`); a pair that falls to the e-section would not rotate.
            if matches!(arch, Arch::Qwen35Moe | Arch::Qwen35) {
                let key = k("rope.dimension_sections");
                let secs: Vec<usize> = g.get(&key).and_then(|v| v.as_array()).ok_or_else(|| ConfigError::Missing(key.clone()))?
                    .iter().map(|v| v.as_u64().unwrap_or(u64::MAX) as usize).collect();
                let ok = secs.len() == 4 && secs.iter().all(|&s| s <= 1 << 16) && {
                    let total: usize = secs.iter().sum();
                    total > 0 && total <= n_rot && (0..n_rot / 2).all(|i| {
                        let sec = i % total;
                        (sec % 3 == 1 && sec < 3 * secs[1]) || (sec % 3 == 2 && sec < 3 * secs[2]) || (sec % 3 == 0 && sec < 3 * secs[0])
                    })
                };
                check("rope.dimension_sections", secs.iter().fold(0usize, |a, &b| a.saturating_add(b)), ok, "must be 4 sections whose t/h/w parts cover every rotated pair (text positions)")?;
            }
            (Some(ssm), recurrent)
        } else {
            (None, vec![false; n_layer])
        };
        // Sliding-window attention (gpt-oss: required, period 2, even layers).
        let (n_swa, swa) = if arch == Arch::GptOss {
            let n_swa = req("attention.sliding_window")?;
            check("attention.sliding_window", n_swa, n_swa > 0, "must be > 0")?;
            let period = opt("attention.sliding_window_pattern").unwrap_or(2);
            check("attention.sliding_window_pattern", period, period > 0 && period <= 1024, "must be in 1..=1024")?;
            // llama.cpp `set_swa_pattern(period)`: layer il slides unless il % period == period − 1.
            (n_swa, (0..n_layer).map(|il| period == 1 || il % period < period - 1).collect())
        } else {
            (0, vec![false; n_layer])
        };
        // smallthinker (llama.cpp `smallthinker.cpp` `load_arch_hparams`): with a sliding window in
        // the file, the window is 4096 whatever its value, layers slide unless il % 4 == 0 (or as
        // `attention.sliding_window_pattern` says) and the others, il % 4 == 0, skip RoPE; without
        // one every layer is global with RoPE. (A file of exactly 4 layers ropes every layer:
        // llama.cpp's test is `n_no_rope_layer_step == n_layer || il % n_no_rope_layer_step != 0`.)
        let (n_swa, swa, nope) = if arch == Arch::SmallThinker {
            match opt("attention.sliding_window").filter(|&w| w > 0) {
                Some(_) => {
                    let swa: Vec<bool> = match g.get(&k("attention.sliding_window_pattern")).and_then(|v| v.as_array()) {
                        Some(a) => {
                            check("attention.sliding_window_pattern", a.len(), a.len() >= n_layer, "must have block_count entries")?;
                            a.iter().take(n_layer).map(|v| v.as_u64().unwrap_or(0) != 0).collect()
                        }
                        None => {
                            let period = opt("attention.sliding_window_pattern").unwrap_or(4);
                            check("attention.sliding_window_pattern", period, period <= 1024, "must be ≤ 1024")?;
                            (0..n_layer).map(|il| period == 0 || il % period != 0).collect()
                        }
                    };
                    // `n_no_rope_layer_step` (4): RoPE when it equals n_layer, or il % 4 != 0.
                    (4096, swa, (0..n_layer).map(|il| n_layer != 4 && il % 4 == 0).collect())
                }
                None => (0, vec![false; n_layer], vec![false; n_layer]),
            }
        } else {
            (n_swa, swa, vec![false; n_layer])
        };
        // `expert_gating_func` (smallthinker: required; llama.cpp aborts without it).
        let gating = match arch {
            Arch::GptOss => Gating::SoftmaxWeight,
            Arch::SmallThinker | Arch::Lfm2Moe => match opt("expert_gating_func") {
                Some(1) => Gating::Softmax,
                Some(2) => Gating::Sigmoid,
                Some(3) => Gating::SoftmaxWeight,
                Some(v) => return Err(ConfigError::UnsupportedValue { key: k("expert_gating_func"), value: v.to_string(), known: "1 (softmax), 2 (sigmoid), 3 (softmax_weight)" }),
                None => return Err(ConfigError::Missing(k("expert_gating_func"))),
            },
            _ => Gating::Softmax,
        };
        // lfm2moe: the short convolution's length, the leading dense layers.
        let shortconv = if arch == Arch::Lfm2Moe {
            let l = opt("shortconv.l_cache").ok_or_else(|| ConfigError::Missing(k("shortconv.l_cache")))?;
            check("shortconv.l_cache", l, (2..=64).contains(&l), "must be in 2..=64")?;
            Some(l)
        } else {
            None
        };
        let n_dense_lead = if arch == Arch::Lfm2Moe { opt("leading_dense_block_count").unwrap_or(0) } else { 0 };
        check("leading_dense_block_count", n_dense_lead, n_dense_lead <= n_layer, "must be ≤ block_count")?;
        if n_dense_lead > 0 {
            check("feed_forward_length", n_ff, n_ff > 0 && n_ff <= 1 << 20, "must be in 1..=1048576 (the leading dense layers' width)")?;
        }
        if arch == Arch::GptOss {
            check("rope.dimension_count", n_rot, n_rot == head_dim, "must equal the head size (llama.cpp uses n_rot as the head size)")?;
        }
        let rope_base = g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0);
        let n_ctx_train = opt("context_length").unwrap_or(2048);
        let yarn = rope_scaling(g, &k, n_ctx_train)?;
        Ok(Config {
            arch,
            n_vocab,
            n_ctx_train,
            n_embd,
            n_layer,
            n_nextn: nextn,
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
            rope_base,
            rope,
            norm_topk: matches!(arch, Arch::Llama | Arch::Qwen3Moe | Arch::Qwen35Moe | Arch::Qwen35 | Arch::Qwen3Next | Arch::SmallThinker | Arch::Lfm2Moe),
            expert_weights_scale: g.get_f32(&k("expert_weights_scale")).unwrap_or(0.0),
            ssm,
            recurrent,
            n_swa,
            swa,
            rope_base_swa: g.get_f32(&k("rope.freq_base_swa")).unwrap_or(rope_base),
            yarn,
            gating,
            expert_act: match arch {
                Arch::GptOss => ExpertAct::SwigluOai { alpha: 1.702, limit: 7.0 },
                Arch::SmallThinker => ExpertAct::Relu,
                _ => ExpertAct::Silu,
            },
            nope,
            shortconv,
            n_dense_lead,
        })
    }

    /// Whether llama.cpp's graph keeps only the last row before the last layer's FFN when only the
    /// last logits are wanted (`inp_out_ids` inside the layer loop: the llama family); the hybrids
    /// and gpt-oss select the row after the last layer.
    pub fn trims_last_layer(&self) -> bool {
        matches!(self.arch, Arch::Llama | Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Olmoe | Arch::SmallThinker | Arch::Lfm2Moe)
    }

    /// Whether layer `il` has routed experts (not one of the leading dense layers).
    pub fn is_moe_layer(&self, il: usize) -> bool {
        self.is_moe() && il >= self.n_dense_lead
    }

    /// Layer `il`'s index among the MoE layers: what the expert source, its stores and the
    /// backends' expert pools number layers by (the leading dense layers have no experts).
    pub fn expert_layer(&self, il: usize) -> usize {
        il.saturating_sub(self.n_dense_lead)
    }

    /// Layers with routed experts.
    pub fn n_moe_layers(&self) -> usize {
        if self.is_moe() { self.n_layer - self.n_dense_lead } else { 0 }
    }

    /// The output norm's tensor (`output_norm.weight`; lfm2's GGUF names it `token_embd_norm`).
    pub fn output_norm_name(&self) -> &'static str {
        if self.arch == Arch::Lfm2Moe { "token_embd_norm.weight" } else { "output_norm.weight" }
    }

    /// f32 lengths of layer `il`'s recurrent state (conv, delta rule); `None` for attention layers.
    pub fn state_lens(&self, il: usize) -> Option<(usize, usize)> {
        if !self.is_recurrent(il) {
            return None;
        }
        match (self.ssm, self.shortconv) {
            (Some(s), _) => Some((s.conv_state_len(), s.ssm_state_len())),
            (None, Some(l)) => Some(((l - 1) * self.n_embd, 0)),
            _ => None,
        }
    }

    /// Whether any layer keeps a recurrent state.
    pub fn has_recurrent(&self) -> bool {
        (0..self.n_layer).any(|il| self.state_lens(il).is_some())
    }

    /// Whether each layer's router runs before the layer's other work, so its experts are known
    /// early (smallthinker: [`crate::expert::ExpertSource::on_route`]).
    pub fn routes_early(&self) -> bool {
        self.arch == Arch::SmallThinker
    }

    /// Whether layer `il`'s attention skips RoPE (NoPE).
    pub fn is_nope(&self, il: usize) -> bool {
        self.nope.get(il).copied().unwrap_or(false)
    }

    /// Whether layer `il` uses sliding-window attention.
    pub fn is_swa(&self, il: usize) -> bool {
        self.swa.get(il).copied().unwrap_or(false)
    }

    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }
    /// The router's rule ([`crate::model::route`]).
    pub fn route_spec(&self) -> crate::backend::ops::RouteSpec {
        crate::backend::ops::RouteSpec { n_expert: self.n_expert, k: self.n_expert_used, gating: self.gating, norm_topk: self.norm_topk, scale: self.expert_weights_scale }
    }
    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
    /// Whether tensor `name` belongs to a multi-token-prediction block (`blk.N.*` with N past the
    /// trunk): the trunk neither loads nor counts it.
    pub fn is_nextn_tensor(&self, name: &str) -> bool {
        self.n_nextn > 0 && tensor_block(name).is_some_and(|il| il >= self.n_layer)
    }

    /// Bytes of the first multi-token-prediction block's tensors (`blk.{n_layer}.*`: what
    /// [`crate::model::Model::load_mtp`] holds) in `g`.
    pub fn mtp_bytes(&self, g: &GgufFile) -> u64 {
        if self.n_nextn == 0 {
            return 0;
        }
        g.tensors.iter().filter(|t| tensor_block(&t.name) == Some(self.n_layer)).map(|t| t.size).sum()
    }

    /// Whether layer `il` is a recurrent (Gated DeltaNet) layer.
    pub fn is_recurrent(&self, il: usize) -> bool {
        self.recurrent.get(il).copied().unwrap_or(false)
    }
    /// Layers with a KV cache (all but the recurrent ones).
    pub fn n_attn_layers(&self) -> usize {
        self.n_layer - self.recurrent.iter().filter(|&&r| r).count()
    }
    /// Bytes of one sequence's cache with `n_ctx` positions: f16 keys and values of the attention
    /// layers, and the recurrent state of the others twice (the state and its checkpoint).
    /// Sliding-window layers count their bounded cells ([`crate::backend::cpu::kv::swa_cells`]).
    pub fn cache_bytes(&self, n_ctx: usize) -> usize {
        let cells: usize = (0..self.n_layer).filter(|&il| !self.is_recurrent(il)).map(|il| self.kv_cells(il, n_ctx)).sum();
        crate::backend::cpu::kv::KvCache::bytes(1, cells, self.n_head_kv, self.head_dim) + 2 * self.recurrent_state_bytes()
    }
    /// KV cells of attention layer `il` in a cache of `n_ctx` positions.
    pub fn kv_cells(&self, il: usize, n_ctx: usize) -> usize {
        match self.window(il) {
            0 => n_ctx,
            w => crate::backend::cpu::kv::swa_cells(w, n_ctx),
        }
    }
    /// The sliding window of layer `il` (0: none).
    pub fn window(&self, il: usize) -> usize {
        if self.is_swa(il) { self.n_swa } else { 0 }
    }
    /// Bytes of recurrent state (conv + delta-rule state, f32) of one sequence.
    pub fn recurrent_state_bytes(&self) -> usize {
        (0..self.n_layer).filter_map(|il| self.state_lens(il)).map(|(a, b)| (a + b) * 4).sum()
    }
}

/// RoPE scaling as llama.cpp sets it up (`llama-model.cpp` `load_hparams`, `llama-context.cpp`):
/// `rope.scaling.type` yarn → `ext_factor` 1 and `attn_factor = m(f) / (1 + 0.1 ln f)` with
/// `m(f) = 0.1 ln f + 1` (so ≈ 1: ggml's `rope_yarn` multiplies by `1 + 0.1 ln f` itself);
/// linear → positions scaled by `1 / factor` only. `rope.scaling.attn_factor` multiplies both.
fn rope_scaling(g: &GgufFile, k: &dyn Fn(&str) -> String, n_ctx_train: usize) -> Result<Option<Yarn>, ConfigError> {
    let ty = g.get_str(&k("rope.scaling.type")).unwrap_or("linear");
    let factor = g.get_f32(&k("rope.scaling.factor")).unwrap_or(0.0);
    let freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
    let bad = |why| ConfigError::Invalid { key: k("rope.scaling.factor"), value: factor as u64, why };
    if !(freq_scale.is_finite() && freq_scale > 0.0) {
        return Err(bad("must be a positive finite number"));
    }
    let attn_mul = g.get_f32(&k("rope.scaling.attn_factor")).unwrap_or(1.0);
    let n_ctx_orig = g.get_u64(&k("rope.scaling.original_context_length")).map(|v| v as usize).unwrap_or(n_ctx_train);
    let beta_fast = g.get_f32(&k("rope.scaling.yarn_beta_fast")).unwrap_or(32.0);
    let beta_slow = g.get_f32(&k("rope.scaling.yarn_beta_slow")).unwrap_or(1.0);
    match ty {
        "none" => Ok(None),
        "yarn" => {
            if n_ctx_orig == 0 || n_ctx_orig > 1 << 30 {
                return Err(ConfigError::Invalid { key: k("rope.scaling.original_context_length"), value: n_ctx_orig as u64, why: "must be in 1..=2^30" });
            }
            let f = 1.0 / freq_scale;
            let mscale = |s: f32| if s <= 1.0 { 1.0 } else { (0.1f32 * 1.0).mul_add(libm::logf(s), 1.0) };
            let mut attn_factor = mscale(f);
            attn_factor *= 1.0 / 0.1f32.mul_add(libm::logf(f), 1.0);
            attn_factor *= attn_mul;
            Ok(Some(Yarn { freq_scale, ext_factor: 1.0, attn_factor, beta_fast, beta_slow, n_ctx_orig }))
        }
        _ if freq_scale == 1.0 && attn_mul == 1.0 => Ok(None),
        "linear" => Ok(Some(Yarn { freq_scale, ext_factor: 0.0, attn_factor: attn_mul, beta_fast, beta_slow, n_ctx_orig })),
        _ => Err(ConfigError::UnsupportedValue { key: k("rope.scaling.type"), value: ty.into(), known: "none, linear, yarn" }),
    }
}
