//! Conversations: a session keeps its cache between generations and reuses the longest common
//! token prefix (the bits of a cold run on the portable kernels, the bits wasm32, aarch64 and the
//! GPU's exact path compute); stop strings; a full context stops or shifts.
//!
//! The portable kernels are forced for the whole binary (`Simd::Scalar`): on x86 with AVX2 the
//! CPU follows llama.cpp's batch kernels, whose order depends on the batch's size, so a reused
//! prefix gives llama.cpp's `cache_prompt` bits (last-bit differences), not a cold run's.

use crate::common::*;
use les::engine::sampling::SamplerConfig;
use les::engine::stream::{open_streaming, StreamOptions};
use les::engine::{ContextMode, FinishReason, GenOptions, Session};
use les::model::{ExpertMode, Logits};
use les::store::FileSource;

fn session(name: &str, n_ctx: usize) -> Session {
    les::quant::Simd::force(les::quant::Simd::Scalar);
    let src = FileSource::open(model(name)).unwrap();
    Session::load(&src, ExpertMode::Resident, n_ctx).unwrap()
}

fn greedy(n: usize) -> GenOptions {
    GenOptions { n, sampler: SamplerConfig::greedy(), ..Default::default() }
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Turn 1 generates; turn 2's prompt starts with turn 1's prompt and reply. With reuse, only
/// the new part runs, and its logits equal a cold run of the whole turn-2 prompt.
fn reuse_equals_cold(s: &mut Session) {
    s.reuse_prefix = true;
    let p1 = s.tokenize("The three primary colors are");
    let (reply, st1) = s.generate_with(&p1, &greedy(12), &mut |_, _| true).unwrap();
    assert_eq!(st1.prompt_reused, 0);
    let mut p2 = p1.clone();
    p2.extend_from_slice(&reply);
    p2.extend(s.tokenizer.encode(" And the secondary colors are", false, true));
    // What the cache holds: turn 1's prompt and every reply token but the last (never fed).
    assert_eq!(s.cached_tokens(), &p2[..p1.len() + reply.len() - 1]);
    let n = s.reuse(&p2);
    assert_eq!(n, p1.len() + reply.len() - 1, "the whole common prefix is kept");
    let warm = s.prefill(&p2[n..]).unwrap();
    s.reset();
    assert_eq!(s.reuse(&p2), 0);
    let cold = s.prefill(&p2).unwrap();
    assert!(bits_equal(&warm, &cold), "logits after reusing {n} cached tokens differ from a cold run");
    // Through generate: the same continuation, with the reuse counted.
    s.reset();
    s.generate_with(&p1, &greedy(12), &mut |_, _| true).unwrap();
    let (warm_out, st2) = s.generate_with(&p2, &greedy(8), &mut |_, _| true).unwrap();
    assert_eq!(st2.prompt_reused, n);
    s.reset();
    let (cold_out, st3) = s.generate_with(&p2, &greedy(8), &mut |_, _| true).unwrap();
    assert_eq!(st3.prompt_reused, 0);
    assert_eq!(warm_out, cold_out);
}

#[test]
fn prefix_reuse_equals_cold_run_smollm2() {
    reuse_equals_cold(&mut session("SmolLM2-135M-Instruct.Q4_1.gguf", 256));
}

#[test]
fn prefix_reuse_equals_cold_run_moe_resident_and_streamed() {
    reuse_equals_cold(&mut session("rand-qwen2moe.gguf", 256));
    // Streamed under a budget of ~30% of the expert bytes.
    let mut o = StreamOptions::every_expert(256);
    o.slots = Some(24); // a few slots per layer: most experts are read on demand
    let mut st = open_streaming(model("rand-qwen2moe.gguf").to_str().unwrap(), &o).unwrap();
    reuse_equals_cold(&mut st.session);
}

/// Gated DeltaNet hybrids: the recurrent state cannot be cut back, so it is kept before each
/// prompt's last token; the next turn (a longer prompt) and the same prompt again (regenerate)
/// come back to it, and a prompt that changes earlier runs from the start.
#[test]
fn prefix_reuse_on_recurrent_models_equals_cold_run() {
    for m in ["rand-qwen35moe.gguf", "rand-qwen3next.gguf"] {
        let mut s = session(m, 256);
        reuse_equals_cold(&mut s);
        s.reset();
        let p = s.tokenize("Once upon a time there was a small robot");
        let (cold, _) = s.generate_with(&p, &greedy(6), &mut |_, _| true).unwrap();
        let (again, st) = s.generate_with(&p, &greedy(6), &mut |_, _| true).unwrap();
        assert_eq!(st.prompt_reused, p.len() - 1, "{m}: regenerate comes back to the checkpoint");
        assert_eq!(again, cold, "{m}: regenerated text differs");
        let mut q = p.clone();
        q[3] = s.tokenizer.encode(" dog", false, true)[0];
        let (_, st) = s.generate_with(&q, &greedy(4), &mut |_, _| true).unwrap();
        assert_eq!(st.prompt_reused, 0, "{m}: no state to go back to before the change: run from the start");
        let (_, st) = s.generate_with(&q, &greedy(4), &mut |_, _| true).unwrap();
        assert_eq!(st.prompt_reused, q.len() - 1);
    }
}

#[test]
fn reuse_off_runs_the_whole_prompt_and_a_changed_prefix_runs_from_the_change() {
    let mut s = session("SmolLM2-135M-Instruct.Q4_1.gguf", 256);
    let p = s.tokenize("Once upon a time there was a small robot");
    s.generate_with(&p, &greedy(4), &mut |_, _| true).unwrap();
    let (_, st) = s.generate_with(&p, &greedy(4), &mut |_, _| true).unwrap();
    assert_eq!(st.prompt_reused, 0, "reuse is off by default");
    s.reuse_prefix = true;
    let (_, st) = s.generate_with(&p, &greedy(4), &mut |_, _| true).unwrap();
    assert_eq!(st.prompt_reused, p.len() - 1, "the same prompt again: all but its last token");
    let mut q = p.clone();
    q[5] = s.tokenizer.encode(" dog", false, true)[0];
    assert_ne!(q[5], p[5]);
    let (_, st) = s.generate_with(&q, &greedy(4), &mut |_, _| true).unwrap();
    assert_eq!(st.prompt_reused, 5, "reuse stops at the first differing token");
}

#[test]
fn stop_string_cuts_the_output_where_plain_output_has_it() {
    let mut s = session("SmolLM2-135M-Instruct.Q4_1.gguf", 256);
    let p = s.tokenize("List the planets of the solar system: Mercury, Venus,");
    let mut plain = String::new();
    let (_, st) = s.generate_with(&p, &greedy(24), &mut |_, t| {
        plain.push_str(t);
        true
    })
    .unwrap();
    assert_eq!(st.finish_reason, Some(FinishReason::Length));
    // A stop string from the middle of the plain output (it may straddle tokens).
    let chars: Vec<char> = plain.chars().collect();
    assert!(chars.len() > 12, "plain output too short: {plain:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 4].iter().collect();
    let want = &plain[..plain.find(&stop).unwrap()];
    let mut got = String::new();
    let o = GenOptions { stop: vec!["never appears 123".into(), stop.clone()], ..greedy(24) };
    let (_, st) = s.generate_with(&p, &o, &mut |_, t| {
        got.push_str(t);
        true
    })
    .unwrap();
    assert_eq!(got, want, "stop {stop:?}");
    assert_eq!(st.finish_reason, Some(FinishReason::Stop));
}

#[test]
fn full_context_stops_or_shifts() {
    let mut s = session("SmolLM2-135M-Instruct.Q4_1.gguf", 48);
    let p = s.tokenize("Write a long story about a lighthouse keeper who finds a map.");
    // Stop: the cache fills and generation ends with `length`.
    let no_eos = GenOptions { ignore_eos: true, ..greedy(200) };
    let (out_stop, st) = s.generate_with(&p, &no_eos, &mut |_, _| true).unwrap();
    assert_eq!(st.finish_reason, Some(FinishReason::Length));
    assert!(p.len() + out_stop.len() <= 48, "{} + {}", p.len(), out_stop.len());
    // Shift: 120 tokens in a 48-token context, keeping the first 4 (+ BOS).
    let o = GenOptions { context: ContextMode::Shift { n_keep: 4 }, ignore_eos: true, ..greedy(120) };
    s.reset();
    let (out_shift, st) = s.generate_with(&p, &o, &mut |_, _| true).unwrap();
    assert_eq!(out_shift.len(), 120);
    assert!(st.context_shifts >= 2, "{} shifts", st.context_shifts);
    assert_eq!(st.finish_reason, Some(FinishReason::Length));
    assert_eq!(&out_shift[..out_stop.len()], &out_stop[..], "identical until the first shift");
    // The cache holds the kept head, then a contiguous tail of the conversation.
    let all: Vec<u32> = p.iter().chain(&out_shift).copied().collect();
    let c = s.cached_tokens().to_vec();
    let keep = 4 + usize::from(s.tokenizer.bos().is_some() && s.tokenizer.bos() == Some(p[0]));
    assert_eq!(&c[..keep], &all[..keep]);
    let tail = &c[keep..];
    assert!(all.windows(tail.len()).any(|w| w == tail), "the cache's tail is a contiguous run of the conversation");
    // And the logits of the next step equal a cold run on that shortened sequence.
    let last = *all.last().unwrap();
    let warm = s.forward(&[last], Logits::Last).unwrap();
    let mut cold_seq = c.clone();
    cold_seq.push(last);
    s.reset();
    let cold = s.prefill(&cold_seq).unwrap();
    assert!(bits_equal(&warm, &cold));
}
