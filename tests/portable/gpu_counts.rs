//! The wgpu backend's calls per decode token (issue 55), counted by the backend itself
//! (`GpuStats::per_token`): deterministic, so held here on lavapipe. Each MoE fixture decodes a
//! few greedy tokens, then the same tokens twice more from a cleared cache (the same routing, so
//! the third pass is the steady state: every pipeline, bind group and buffer already made, every
//! routed expert already in a GPU slot; the second still binds a few buffers the first pass
//! created in another order). Per decode token of the third pass:
//! - no bind groups, no buffers created, no `clear_buffer`: bind groups are cached (the arena's
//!   parameters at dynamic offsets), pooled buffers handed out in a fixed order, act_quant.wgsl
//!   zeroes its own rows;
//! - one submit, one readback (the logits) and one compute pass: every expert is in a GPU slot
//!   (a resident source's experts are uploaded when the backend is made), so each MoE layer
//!   routes on the device (shaders/route.wgsl) instead of reading its router logits back;
//! - dispatches at most the counts of the current encoding (before it: 246 on rand-qwen35moe,
//!   291 on rand-gpt-oss, issue 55): the FFN input quantized once per layer, and the routed
//!   experts `mul_mat_id`-style (gate, up, activation, down of all k in one dispatch each, then
//!   one weighted combine; gpt-oss adds its three bias rows per expert in one dispatch each).
//! The logits of the first and third passes are bit-identical.

use crate::common::*;
use les::backend::wgpu::exec::GpuOptions;
use les::backend::BackendKind;
use les::engine::Session;
use les::model::{ExpertMode, Logits};
use les::store::FileSource;

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

#[test]
fn resident_decode_calls_per_token_on_lavapipe() {
    les::quant::Simd::force(les::quant::Simd::Scalar);
    // (fixture, most dispatches per decode token)
    for (name, max_dispatches) in [("rand-qwen35moe", 127.0), ("rand-qwen3next", 130.0), ("rand-gpt-oss", 129.0), ("rand-llama-moe", 100.0), ("rand-lfm2moe", 141.0)] {
        let src = FileSource::open(model(&format!("{name}.gguf"))).unwrap();
        let mut s = Session::load(&src, ExpertMode::Resident, 256).unwrap();
        s.set_backend(BackendKind::Wgpu, &GpuOptions { exact: Some(true), device_routing: Some(true), ..Default::default() }).unwrap();
        let prompt = s.tokenize("The capital of France is");
        let run = |s: &mut Session, toks: &[u32]| -> (Vec<u32>, Vec<Vec<f32>>) {
            s.reset();
            let mut logits = vec![s.prefill(&prompt).unwrap()];
            s.gpu.as_ref().unwrap().reset_stats();
            let mut out = Vec::new();
            for i in 0..4 {
                let t = toks.get(i).copied().unwrap_or_else(|| argmax(logits.last().unwrap()));
                out.push(t);
                logits.push(s.forward(&[t], Logits::Last).unwrap());
            }
            (out, logits)
        };
        let (toks, first) = run(&mut s, &[]);
        run(&mut s, &toks);
        let (_, second) = run(&mut s, &toks);
        assert!(first.iter().zip(&second).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())), "{name}: the passes' logits differ");
        let st = s.gpu.as_ref().unwrap().stats();
        assert_eq!(st.decode_forwards, 4, "{name}");
        let r = st.per_token();
        eprintln!("{name}: {r}");
        assert_eq!((r.bind_groups, r.buffers, r.clears), (0.0, 0.0, 0.0), "{name}: {r}");
        // Every expert in a GPU slot: each layer routes on the device, so the token is one submit
        // and one readback (the logits), in one compute pass.
        assert_eq!((r.readbacks, r.submits, r.passes), (1.0, 1.0, 1.0), "{name}: {r}");
        assert!(r.dispatches <= max_dispatches, "{name}: {r}");
        assert_eq!(st.experts.uploads, 0, "{name}: the third pass uploads nothing");
    }
}
