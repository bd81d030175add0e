//! Weights repacked four rows at a time (`quant::repack`, the layout the wasm relaxed-SIMD
//! kernels read) give a model the logits of the file's layout, bit for bit: prompts (groups ×
//! four tokens and a tail of tokens), decode steps, the tied embedding table looked up from the
//! repacked rows, experts, and the file's bytes back for a GPU upload.

use crate::common::*;
use les::engine::Session;
use les::expert::{ExpertSource, ResidentExperts};
use les::model::ExpertMode;
use les::store::FileSource;
use std::sync::Arc;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A prompt of 7 tokens, then two decode steps: the logits of each.
fn run(s: &mut Session) -> Vec<Vec<u32>> {
    s.reset();
    let mut p = s.tokenize("The three primary colors are red,");
    p.truncate(7);
    assert_eq!(p.len(), 7);
    let mut out = vec![bits(&s.prefill(&p).unwrap())];
    for t in [p[1], p[3]] {
        out.push(bits(&s.prefill(&[t]).unwrap()));
    }
    out
}

#[test]
fn repacked_weights_give_the_files_logits() {
    les::quant::Simd::force(les::quant::Simd::Scalar);
    // SmolLM2: Q4_1 layers and a tied Q8_0 embedding table; the MoE fixture: Q8_0 matrices of
    // several shapes (and other types, left as they are).
    for name in ["SmolLM2-135M-Instruct.Q4_1.gguf", "rand-qwen2moe.gguf"] {
        let src = FileSource::open(model(name)).unwrap();
        let mut s = Session::load(&src, ExpertMode::Resident, 64).unwrap();
        assert_eq!(s.model.weights.mats().iter().filter(|w| w.repacked).count(), 0, "{name}: repacked on a native build");
        let file: Vec<Vec<u8>> = s.model.weights.mats().iter().map(|w| w.data.clone()).collect();
        let plain = run(&mut s);
        let bytes = s.model.weights.repack(true);
        assert!(bytes > 0, "{name}: nothing repacked");
        let changed = s.model.weights.mats().iter().zip(&file).filter(|(w, f)| w.repacked && w.data != **f).count();
        assert!(changed > 0, "{name}: repacked matrices keep the file's bytes");
        assert_eq!(run(&mut s), plain, "{name}: logits differ once repacked");
        if s.model.cfg.is_moe() {
            // The experts too (the fixture's Q8_0 ones), each block's three matrices apart.
            let mut ex = ResidentExperts::load(&src, &s.model.expert_tensors, s.model.cfg.n_expert).unwrap();
            ex.repack(true);
            let mut n = 0;
            for l in 0..s.model.cfg.n_layer {
                ex.with_experts(l, &[0], &mut |_, b| n += b.repacked.iter().filter(|&&r| r).count()).unwrap();
            }
            assert!(n > 0, "{name}: no expert matrix repacked");
            s.model.set_experts(Arc::new(ex));
            assert_eq!(run(&mut s), plain, "{name}: logits differ with repacked experts");
        }
        s.model.weights.unpack();
        assert!(s.model.weights.mats().iter().zip(&file).all(|(w, f)| !w.repacked && w.data == *f), "{name}: unpacked bytes differ from the file's");
    }
}
