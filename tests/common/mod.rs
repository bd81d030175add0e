//! Shared helpers for tests that compare LES with llama.cpp reference files.
#![allow(dead_code)]

use les::quant::GgmlType;
use serde_json::Value;
use std::path::PathBuf;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Path of a model under models/; panics with set-up instructions when it is missing (CI always
/// prepares them, so a missing model is a failure, not a skip).
pub fn model(name: &str) -> PathBuf {
    let p = root().join("models").join(name);
    assert!(p.exists(), "{} is missing: run ./build.sh test (or tools/fetch_models.sh / tools/build_models.sh small)", p.display());
    p
}

pub struct RefRow {
    pub argmax: u32,
    pub margin: f32,
    pub top: Vec<(u32, f32)>,
}

pub struct RefPrompt {
    pub prompt: String,
    pub prompt_tokens: Vec<u32>,
    pub generated: Vec<u32>,
    pub rows: Vec<RefRow>,
}

pub struct Refs {
    pub llama_cpp: String,
    pub prompts: Vec<RefPrompt>,
}

fn f(v: &Value) -> f32 {
    v.as_f64().unwrap_or(f64::NAN) as f32
}

pub fn load_refs(stem: &str) -> Refs {
    let p = root().join("tests/fixtures/refs").join(format!("{stem}.json"));
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let v: Value = serde_json::from_str(&s).unwrap();
    let ids = |a: &Value| a.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let prompts = v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| RefPrompt {
            prompt: p["prompt"].as_str().unwrap().to_string(),
            prompt_tokens: ids(&p["prompt_tokens"]),
            generated: ids(&p["generated"]),
            rows: p["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| RefRow {
                    argmax: r["argmax"].as_u64().unwrap() as u32,
                    margin: f(&r["margin"]),
                    top: r["top"].as_array().unwrap().iter().map(|t| (t[0].as_u64().unwrap() as u32, f(&t[1]))).collect(),
                })
                .collect(),
        })
        .collect();
    Refs { llama_cpp: v["llama_cpp"].as_str().unwrap_or("").to_string(), prompts }
}

/// The weight types of the block fixtures `tests/fixtures/quant/weights_<TYPE>.bin` (gguf-py's
/// bytes, 2 rows × 512): every type the GGUF files LES loads use, and the wgpu matvec supports.
pub const WEIGHT_TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// `n` token ids below `vocab` from a 64-bit LCG seeded with `seed` (Knuth's MMIX constants).
pub fn random_tokens(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// The long test matrices (`LES_FULL_TESTS=1`, `tools/test_full.sh`) instead of the default run's
/// short ones.
pub fn full_tests() -> bool {
    std::env::var_os("LES_FULL_TESTS").is_some()
}

/// Run one test of this test binary again in a child process with `env` set (settings that hold
/// for a whole process: the kernel level, the wgpu backend), and assert that it ran and passed.
/// `module` is the caller's `module_path!()`, `name` the test function's name.
pub fn rerun_with_env(module: &str, name: &str, env: &[(&str, &str)]) {
    let path = match module.split_once("::") {
        Some((_crate, m)) => format!("{m}::{name}"),
        None => name.to_string(),
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &path, "--nocapture", "--test-threads", "1"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{path} with {env:?} failed:\n{stdout}");
    assert!(stdout.contains("1 passed"), "{path} with {env:?} did not run:\n{stdout}");
}
