//! `les eval ppl`: perplexity as llama.cpp's `llama-perplexity` computes it, checked against its
//! figures for the committed held-out text (tests/fixtures/eval/ppl_refs.json, made by
//! tools/make_ppl_refs.sh), and the KL divergence between models.

use crate::common::*;
use les::engine::eval::perplexity;
use les::engine::Session;
use les::model::ExpertMode;
use les::store::FileSource;

fn session(name: &str) -> Session {
    let src = FileSource::open(model(name)).unwrap();
    Session::load_with_batch(&src, ExpertMode::Resident, 256, 64).unwrap()
}

fn heldout() -> String {
    std::fs::read_to_string(root().join("tests/fixtures/eval/heldout.txt")).unwrap()
}

fn reference(name: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root().join("tests/fixtures/eval/ppl_refs.json")).unwrap()).unwrap();
    v[name].as_f64().unwrap()
}

#[test]
fn perplexity_matches_llama_cpp() {
    let text = heldout();
    // Real weights: within 1% of llama.cpp's PPL; random weights (PPL ~1e11): within 5%.
    for (name, tol_ln) in [("SmolLM2-135M-Instruct.Q4_1.gguf", 0.01), ("smolmoe-32x2.gguf", 0.01), ("rand-olmoe.gguf", 0.05)] {
        let mut s = session(name);
        let r = perplexity(&mut s, None, &text, 256).unwrap();
        let want = reference(name);
        eprintln!("{name}: LES PPL {:.4} over {} chunks / {} scored tokens; llama.cpp {want:.4}", r.ppl, r.chunks, r.scored);
        assert_eq!(r.chunks, 4, "llama.cpp scores 4 chunks of 256 tokens of this text");
        assert_eq!(r.scored, 4 * 127);
        assert!((r.ppl.ln() - want.ln()).abs() < tol_ln, "{name}: PPL {} vs llama.cpp {want}", r.ppl);
    }
}

#[test]
fn kl_divergence_against_a_base() {
    let text = heldout();
    let mut a = session("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut b = session("SmolLM2-135M-Instruct.Q4_1.gguf");
    let r = perplexity(&mut a, Some(&mut b), &text, 256).unwrap();
    assert_eq!(r.kl, Some(0.0), "a model against itself");
    assert_eq!(r.same_top, Some(1.0));
    let mut m = session("smolmoe-32x2.gguf");
    let r = perplexity(&mut m, Some(&mut b), &text, 256).unwrap();
    let kl = r.kl.unwrap();
    eprintln!("SmolMoE-32x2 vs SmolLM2: KL {kl:.5} nats/token, same top-1 {:.1}%, PPL {:.3} vs {:.3}", 100.0 * r.same_top.unwrap(), r.ppl, r.base_ppl.unwrap());
    assert!(kl > 0.0 && kl < 1.0, "the upcycled MoE stays close to the dense model: KL {kl}");
    assert!((r.base_ppl.unwrap().ln() - reference("SmolLM2-135M-Instruct.Q4_1.gguf").ln()).abs() < 0.01);
}
