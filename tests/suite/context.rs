//! Long contexts in bounded memory (issue 37 item 3): a sliding-window layer keeps a bounded run
//! of cells (llama.cpp's SWA cache keeps `n_swa + n_ubatch`) and gives the bits of a cache that
//! keeps every position; a rollback further back than its cells reach starts over.

use crate::common::*;
use les::backend::cpu::kv::KvCache;
use les::engine::Session;
use les::model::{ExpertMode, Logits};
use les::store::FileSource;

fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|x| x.to_bits()).collect()
}

/// rand-gpt-oss (GGUF: 4 layers, `attention.sliding_window` 16 on layers 0 and 2, 2 KV heads of
/// 64): a 1500-token prompt in batches of 512, 40 greedy steps, a rollback of 30 tokens and a
/// rollback past the window's cells, against the same model with every position kept.
#[test]
fn a_sliding_window_keeps_bounded_cells_with_the_full_caches_bits() {
    let n_ctx = 4096;
    let src = FileSource::open(model("rand-gpt-oss.gguf")).unwrap();
    let mut ring = Session::load(&src, ExpertMode::Resident, n_ctx).unwrap();
    let mut full = Session::load(&src, ExpertMode::Resident, n_ctx).unwrap();
    full.kv = KvCache::hybrid(&[None; 4], n_ctx, 2, 64);
    // f16 keys and values: two full layers of 4096 cells, two windowed ones of
    // 16 (window) + 512 (batch) + 64 (rollback) + 64 (alignment) cells.
    let per_cell = 2 * 2 * 64 * 2;
    assert_eq!(full.kv.kv_bytes(), 4 * n_ctx * per_cell);
    assert_eq!(ring.kv.kv_bytes(), (2 * n_ctx + 2 * (16 + 512 + 64 + 64)) * per_cell);
    let bytes = ring.kv.kv_bytes();

    let vocab = ring.model.cfg.n_vocab as u32;
    let prompt = random_tokens(1500, vocab, 7);
    let (a, b) = (ring.prefill(&prompt).unwrap(), full.prefill(&prompt).unwrap());
    assert_eq!(bits(&a), bits(&b), "prompt logits");
    let mut next = argmax(&a);
    for step in 0..40 {
        let (a, b) = (ring.forward(&[next], Logits::Last).unwrap(), full.forward(&[next], Logits::Last).unwrap());
        assert_eq!(bits(&a), bits(&b), "step {step}");
        next = argmax(&a);
    }
    // A rollback within the kept cells (speculative decoding, a regenerated reply).
    let back = ring.kv.len - 30;
    assert_eq!(ring.kv.truncate(back), back);
    assert_eq!(full.kv.truncate(back), back);
    let again = random_tokens(70, vocab, 9);
    let (a, b) = (ring.forward(&again, Logits::All).unwrap(), full.forward(&again, Logits::All).unwrap());
    assert_eq!(bits(&a), bits(&b), "after a rollback of 30");
    assert_eq!(ring.kv.kv_bytes(), bytes, "batches of at most 512 never grow the cells");
    // Further back than the cells reach: the cache starts over (the caller feeds everything).
    assert_eq!(ring.kv.truncate(100), 0);
    assert_eq!(full.kv.truncate(100), 100);
    let (a, b) = (ring.prefill(&prompt[..600]).unwrap(), full.kv.truncate(0));
    assert_eq!(b, 0);
    let b = full.prefill(&prompt[..600]).unwrap();
    assert_eq!(bits(&a), bits(&b), "after starting over");
}

/// A copy of fixture `name` whose `{arch}.context_length` (a GGUF u32: key, type 4, value) says
/// `n`, the rest byte for byte.
fn with_context_length(name: &str, arch: &str, n: u32) -> std::path::PathBuf {
    let mut b = std::fs::read(model(name)).unwrap();
    let key = format!("{arch}.context_length");
    let mut pat = (key.len() as u64).to_le_bytes().to_vec();
    pat.extend(key.as_bytes());
    pat.extend(4u32.to_le_bytes());
    let at = b.windows(pat.len()).position(|w| w == pat).expect("context_length key") + pat.len();
    b[at..at + 4].copy_from_slice(&n.to_le_bytes());
    let out = std::env::temp_dir().join(format!("les-ctx-{}-{n}-{name}", std::process::id()));
    std::fs::write(&out, b).unwrap();
    out
}

/// `les run` with a context of 4096 tokens (32768 with `LES_FULL_TESTS`: the fixtures'
/// `context_length` raised in a copy) under a 64 MiB budget: the prompt fills the context and
/// the peak resident memory `les run` reports stays within the budget + 64 MiB.
#[test]
fn a_long_context_stays_within_the_budget() {
    let n: u32 = if full_tests() { 32768 } else { 4096 };
    // ~1 token per word on both fixtures' vocabularies; 90% of the context.
    let words = ["alpha", "river", "stone", "light", "green", "cloud", "paper", "seven", "under", "quiet"];
    let text: Vec<&str> = random_tokens(n as usize * 9 / 10, words.len() as u32, 3).iter().map(|&i| words[i as usize]).collect();
    let prompt = std::env::temp_dir().join(format!("les-ctx-{}-{n}.txt", std::process::id()));
    std::fs::write(&prompt, text.join(" ")).unwrap();
    for (name, arch) in [("rand-gpt-oss.gguf", "gpt-oss"), ("rand-qwen35moe.gguf", "qwen35moe")] {
        let file = with_context_length(name, arch, n);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_les"))
            .args(["run", "--model", &file.to_string_lossy(), "--memory-budget", "64MiB", "--ctx-size", &n.to_string(), "-n", "4", "--temp", "0", "-f"])
            .arg(&prompt)
            .output()
            .unwrap();
        std::fs::remove_file(&file).ok();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {err}");
        let line = err.lines().find(|l| l.contains("peak memory")).unwrap_or_else(|| panic!("{name}: no peak memory in {err}"));
        let toks: usize = line.split("prompt ").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).unwrap();
        assert!(toks > n as usize / 2, "{name}: a prompt of {toks} tokens does not fill a context of {n}");
        let peak: f64 = line.split("peak memory ").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).unwrap();
        assert!(peak <= 64.0 + 64.0, "{name}: peak {peak} MiB with a 64 MiB budget at {n} tokens: {line}");
    }
    std::fs::remove_file(&prompt).ok();
}
