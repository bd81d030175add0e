//! Hyper-parameters of the Gated DeltaNet hybrids (`qwen35moe`, `qwen3next`) read from GGUF
//! metadata: hostile values are typed errors (never a panic or an unbounded allocation), and the
//! layer pattern and state sizes are llama.cpp's (`src/models/qwen35moe.cpp`
//! `load_arch_hparams`, `src/llama-hparams.cpp` `n_embd_r` / `n_embd_s`).

use crate::common::*;
use les::gguf::{GgufFile, Value};
use les::model::config::{ConfigError, HeadMap};
use les::model::Config;
use les::store::FileSource;

fn read(name: &str) -> GgufFile {
    GgufFile::read(&FileSource::open(model(name)).unwrap()).unwrap()
}

fn set(g: &mut GgufFile, key: &str, v: Value) {
    let slot = g.metadata.iter_mut().find(|(k, _)| k == key).unwrap_or_else(|| panic!("fixture has no {key}"));
    slot.1 = v;
}

#[test]
fn layer_pattern_and_state_sizes_are_llama_cpps() {
    // rand-qwen35moe: 4 layers, full_attention_interval 4: layers 0-2 linear, 3 attention;
    // S 64, 2 key heads, 4 value heads, conv 4.
    let c = Config::from_gguf(&read("rand-qwen35moe.gguf")).unwrap();
    assert_eq!(c.recurrent, vec![true, true, true, false]);
    let s = c.ssm.unwrap();
    assert_eq!(s.head_map, HeadMap::Tiled);
    assert_eq!(s.conv_dim(), 2 * 2 * 64 + 4 * 64);
    assert_eq!(s.conv_state_len(), 3 * 512); // n_embd_r = (d_conv - 1) * (d_inner + 2 n_group d_state)
    assert_eq!(s.ssm_state_len(), 64 * 256); // n_embd_s = d_state * d_inner
    assert_eq!(c.recurrent_state_bytes(), 3 * (3 * 512 + 64 * 256) * 4);
    assert_eq!(c.n_attn_layers(), 1);
    // rand-qwen3next: interval 2: layers 1 and 3 attention; grouped heads.
    let c = Config::from_gguf(&read("rand-qwen3next.gguf")).unwrap();
    assert_eq!(c.recurrent, vec![true, false, true, false]);
    assert_eq!(c.ssm.unwrap().head_map, HeadMap::Grouped);
}

#[test]
fn hostile_hybrid_hyper_parameters_are_typed_errors() {
    let a = "qwen35moe";
    let cases: Vec<(&str, Value, &str)> = vec![
        ("ssm.state_size", Value::U32(0), "ssm.state_size"),
        ("ssm.state_size", Value::U32(u32::MAX), "ssm.state_size"),
        ("ssm.group_count", Value::U32(0), "ssm.group_count"),
        ("ssm.time_step_rank", Value::U32(3), "ssm.time_step_rank"), // not a multiple of 2 key heads
        ("ssm.time_step_rank", Value::U32(0), "ssm.time_step_rank"),
        ("ssm.inner_size", Value::U32(255), "ssm.inner_size"),
        ("ssm.conv_kernel", Value::U32(1), "ssm.conv_kernel"),
        ("ssm.conv_kernel", Value::U32(1 << 30), "ssm.conv_kernel"),
        ("full_attention_interval", Value::U32(0), "full_attention_interval"),
        ("expert_count", Value::U32(0), "expert_count"),
        ("attention.head_count", Value::U32(0), "attention.head_count"),
        ("rope.dimension_sections", Value::Array(vec![Value::I32(0); 4]), "rope.dimension_sections"),
        ("rope.dimension_sections", Value::Array(vec![Value::I32(100), Value::I32(0), Value::I32(0), Value::I32(0)]), "rope.dimension_sections"),
        ("rope.dimension_sections", Value::Array(vec![Value::I32(-1), Value::I32(3), Value::I32(2), Value::I32(0)]), "rope.dimension_sections"),
        // Sections that leave rotated pairs to the vision (e) section: not text RoPE.
        ("rope.dimension_sections", Value::Array(vec![Value::I32(1), Value::I32(1), Value::I32(1), Value::I32(5)]), "rope.dimension_sections"),
        ("rope.dimension_sections", Value::Array(vec![Value::I32(3), Value::I32(3)]), "rope.dimension_sections"),
        ("block_count", Value::U32(0), "block_count"),
    ];
    for (key, v, want) in cases {
        let mut g = read("rand-qwen35moe.gguf");
        set(&mut g, &format!("{a}.{key}"), v.clone());
        match Config::from_gguf(&g) {
            Err(ConfigError::Invalid { key: k, .. }) => assert_eq!(k, format!("{a}.{want}"), "{key} = {v:?}"),
            other => panic!("{key} = {v:?}: expected an invalid-hyper-parameter error, got {other:?}"),
        }
    }
    // A state size the largest values allowed one by one still bound: 1024 × 1024 heads.
    let mut g = read("rand-qwen35moe.gguf");
    for (k, v) in [("ssm.state_size", 1024), ("ssm.time_step_rank", 1024), ("ssm.group_count", 1024), ("ssm.inner_size", 1024 * 1024)] {
        set(&mut g, &format!("{a}.{k}"), Value::U32(v));
    }
    assert!(matches!(Config::from_gguf(&g), Err(ConfigError::Invalid { .. })), "a 4 GiB-per-layer state must be refused");
    // lfm2moe: a per-layer `head_count_kv` of the wrong length or without an attention layer, no
    // `shortconv.l_cache`, a kernel of length 1, more dense layers than layers.
    let a2 = "lfm2moe";
    let kv = |v: &[u32]| Value::Array(v.iter().map(|&x| Value::U32(x)).collect());
    for (key, v, want) in [
        ("attention.head_count_kv", kv(&[0, 0, 2]), "attention.head_count_kv"),
        ("attention.head_count_kv", kv(&[0; 6]), "attention.head_count_kv"),
        ("attention.head_count_kv", kv(&[0, 0, 2, 0, 4, 0]), "attention.head_count_kv"),
        ("shortconv.l_cache", Value::U32(1), "shortconv.l_cache"),
        ("leading_dense_block_count", Value::U32(7), "leading_dense_block_count"),
    ] {
        let mut g = read("rand-lfm2moe.gguf");
        set(&mut g, &format!("{a2}.{key}"), v.clone());
        match Config::from_gguf(&g) {
            Err(ConfigError::Invalid { key: k, .. }) => assert_eq!(k, format!("{a2}.{want}"), "{key} = {v:?}"),
            other => panic!("{key} = {v:?}: expected an invalid-hyper-parameter error, got {other:?}"),
        }
    }
    let mut g = read("rand-lfm2moe.gguf");
    set(&mut g, "lfm2moe.shortconv.l_cache", Value::String("3".into()));
    let r = Config::from_gguf(&g);
    assert!(matches!(&r, Err(ConfigError::Missing(k)) if k == "lfm2moe.shortconv.l_cache"), "{r:?}");
    // A key of the wrong type reads as missing.
    let mut g = read("rand-qwen35moe.gguf");
    set(&mut g, &format!("{a}.ssm.conv_kernel"), Value::String("4".into()));
    assert!(matches!(Config::from_gguf(&g), Err(ConfigError::Missing(k)) if k == "qwen35moe.ssm.conv_kernel"));
}

/// gpt-oss (llama.cpp `openai-moe.cpp` `load_arch_hparams`, `llama-context.cpp`): sliding
/// window on even layers (pattern 2), YaRN from `rope.scaling.*`, softmax over the top-k logits.
#[test]
fn gpt_oss_hyper_parameters_are_llama_cpps() {
    use les::model::config::Gating;
    let c = Config::from_gguf(&read("rand-gpt-oss.gguf")).unwrap();
    assert_eq!((c.n_swa, c.swa.clone()), (16, vec![true, false, true, false]));
    assert_eq!(c.gating, Gating::SoftmaxWeight);
    let y = c.yarn.unwrap();
    assert_eq!((y.freq_scale, y.ext_factor, y.n_ctx_orig), (1.0 / 32.0, 1.0, 4096));
    // attn_factor = get_mscale(32) / (1 + 0.1 ln 32): 1 within an ulp (ggml's rope_yarn applies the 1.35).
    assert!((y.attn_factor - 1.0).abs() <= f32::EPSILON, "attn_factor {}", y.attn_factor);
    // gpt-oss-20b's correction dims (head size 64, base 150000, 4096 positions, beta 32 / 1):
    // HF's unrounded 8.09 and 17.40 (`_compute_yarn_parameters`, truncate), floored / ceiled by ggml.
    assert_eq!(les::backend::cpu::ops::yarn_corr_dims(64, 4096, 150000.0, 32.0, 1.0), [8.0, 18.0]);
    // A hostile window is a typed error.
    let mut g = read("rand-gpt-oss.gguf");
    set(&mut g, "gpt-oss.attention.sliding_window", Value::U32(0));
    assert!(matches!(Config::from_gguf(&g), Err(ConfigError::Invalid { .. })));
    let mut g = read("rand-gpt-oss.gguf");
    set(&mut g, "gpt-oss.rope.scaling.type", Value::String("longrope".into()));
    assert!(matches!(Config::from_gguf(&g), Err(ConfigError::UnsupportedValue { .. })));
}

/// The byte counts of `les inspect`'s "context memory:" line, and the line.
fn context_memory(name: &str) -> (Vec<u64>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_les")).args(["inspect", &model(name).to_string_lossy()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("context memory:")).unwrap_or_else(|| panic!("no context memory line in:\n{text}"));
    let bytes: Vec<u64> = line.split(" bytes)").filter_map(|p| p.rsplit('(').next()?.trim().parse().ok()).collect();
    (bytes, line.to_string())
}

/// `les inspect` says what a context costs: per 1k tokens, f16 keys and values of the attention
/// layers only (GGUF: 4 blocks, `full_attention_interval` 4 → one attention layer, 2 KV heads,
/// key and value length 64); fixed, the recurrent state of the three linear layers twice (the
/// state and its checkpoint; llama.cpp's `n_embd_r` + `n_embd_s` f32 values per layer).
#[test]
fn inspect_prints_context_memory_per_1k_tokens() {
    let (bytes, line) = context_memory("rand-qwen35moe.gguf");
    let per_1k = 1 * 2 * (64 + 64) * 2 * 1024;
    let fixed = 2 * 3 * (3 * (2 * 2 * 64 + 4 * 64) + 64 * 4 * 64) * 4;
    assert_eq!(bytes, vec![per_1k, fixed], "{line}");
}

/// gpt-oss: per 1k tokens the two full-attention layers only (2 KV heads of 64, f16 keys and
/// values); fixed, the two sliding-window layers' cells (window 16 + batch 512 + rollback 64 +
/// alignment 64).
#[test]
fn inspect_counts_sliding_window_layers_as_fixed() {
    let (bytes, line) = context_memory("rand-gpt-oss.gguf");
    let per_cell = 2 * 2 * 64 * 2;
    assert_eq!(bytes, vec![2 * 1024 * per_cell, 2 * (16 + 512 + 64 + 64) * per_cell], "{line}");
}
