//! Layer-wise mixed precision (`les pack --mixed-precision --target-bytes N`): measure how much
//! each MoE layer's experts can lose, pick per-layer expert types under a byte target, and pack.
//!
//! Sensitivity of layer l to types T = mean KL(original ‖ model with only layer l's experts
//! re-quantized to T) over the next-token distributions of a calibration text (every position of
//! one chunk). Re-quantization: dequantize to f32, quantize with llama-quantize's reference
//! quantizers (`quant::quantize`). The choice is greedy: starting from the original types, apply
//! the cheapest-per-byte step (least added KL per byte saved, summed over layers as if layers added
//! independently) until the expert bytes fit the target.

use super::stream::{open_streaming, OpenError, StreamOptions};
use super::EngineError;
use crate::expert::bundle::{requant_layout, requantize_expert, BundleError};
use crate::expert::stream::StreamingExperts;
use crate::expert::{ExpertBlock, ExpertError, ExpertLayout, ExpertSource};
use crate::gguf::GgufFile;
use crate::model::Logits;
use crate::quant::GgmlType;
use crate::store::FileSource;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum MixedError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Expert(#[from] ExpertError),
    #[error("mixed precision needs a GGUF MoE model as input")]
    NotGguf,
    #[error("the calibration text has {0} tokens; give at least 16")]
    ShortCalibration(usize),
    #[error("target {target} bytes of experts is below the smallest packing the candidate types reach ({min} bytes)")]
    Unreachable { target: u64, min: u64 },
}

/// One option for a layer: its types, bytes per expert, and measured mean KL (nats/token).
#[derive(Clone, Debug)]
pub struct LayerOption {
    pub types: [GgmlType; 3],
    pub bytes_per_expert: usize,
    pub kl: f64,
}

/// Options of every MoE layer (index 0 of each: the original types, KL 0).
#[derive(Clone, Debug)]
pub struct Sensitivity {
    pub n_expert: usize,
    pub layers: Vec<Vec<LayerOption>>,
    pub calibration_tokens: usize,
}

/// Candidate types for a layer: gate/up kept or Q4_0, down kept or Q4_K/Q3_K/Q2_K/Q4_0, where
/// the row lengths allow the block size and the result is smaller than the original.
pub fn candidates(l: &ExpertLayout) -> Vec<[GgmlType; 3]> {
    use GgmlType::*;
    let mut gu = vec![l.gate_ty];
    if l.gate_ty == l.up_ty && !gu.contains(&Q4_0) {
        gu.push(Q4_0);
    }
    let mut down = vec![l.down_ty];
    for t in [Q4K, Q3K, Q2K, Q4_0] {
        if !down.contains(&t) {
            down.push(t);
        }
    }
    let mut out = Vec::new();
    for &g in &gu {
        for &d in &down {
            let tys = [g, if g == l.gate_ty { l.up_ty } else { g }, d];
            if tys == [l.gate_ty, l.up_ty, l.down_ty] {
                continue;
            }
            if let Ok(nl) = requant_layout(l, tys) {
                if nl.bytes() < l.bytes() {
                    out.push(tys);
                }
            }
        }
    }
    out
}

/// Every expert of one layer from `inner`, except `layer`'s, which come re-quantized.
struct OverrideLayer {
    inner: Arc<StreamingExperts>,
    layer: usize,
    layout: ExpertLayout,
    blocks: Vec<ExpertBlock>,
}

impl ExpertSource for OverrideLayer {
    fn layout(&self, layer: usize) -> &ExpertLayout {
        if layer == self.layer { &self.layout } else { self.inner.layout(layer) }
    }
    fn with_experts(&self, layer: usize, ids: &[u32], f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError> {
        if layer != self.layer {
            return self.inner.with_experts(layer, ids, f);
        }
        for (i, &e) in ids.iter().enumerate() {
            let b = self.blocks.get(e as usize).ok_or_else(|| ExpertError::Invalid { layer, expert: e as usize, why: "no such expert".into() })?;
            f(i, b);
        }
        Ok(())
    }
}

/// Mean KL(p ‖ q) over rows of `n_vocab` logits.
fn mean_kl(base: &[f32], model: &[f32], n_vocab: usize) -> f64 {
    let lsm = super::eval::log_softmax;
    let rows = base.len() / n_vocab;
    let mut kl = 0.0;
    for (a, b) in base.chunks_exact(n_vocab).zip(model.chunks_exact(n_vocab)) {
        let (p, q) = (lsm(a), lsm(b));
        kl += p.iter().zip(&q).map(|(&lp, &lq)| lp.exp() * (lp - lq)).sum::<f64>();
    }
    kl / rows.max(1) as f64
}

/// Measure every layer's sensitivity to each of its [`candidates`] on `calibration` (its first
/// `n_tok` tokens). `progress(done, total)` after each measurement.
pub fn measure(path: &str, calibration: &str, n_tok: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<Sensitivity, MixedError> {
    let src = FileSource::open(path).map_err(OpenError::from)?;
    let g = GgufFile::read(&src).map_err(EngineError::from)?;
    if g.tensors.iter().all(|t| !t.name.contains("_exps.")) {
        return Err(MixedError::NotGguf);
    }
    let mut so = StreamOptions::every_expert(n_tok.max(16));
    so.cache.prefetch = false;
    let mut st = open_streaming(path, &so)?;
    let mut toks = st.session.tokenizer.encode(calibration, true, false);
    toks.truncate(n_tok);
    if toks.len() < 16 {
        return Err(MixedError::ShortCalibration(toks.len()));
    }
    let n_vocab = st.session.model.cfg.n_vocab;
    st.session.kv.clear();
    let base = st.session.forward(&toks, Logits::All)?;
    let experts = st.experts.clone();
    let n_layers = st.session.model.cfg.n_layer;
    let n_expert = st.session.model.cfg.n_expert;
    let plan: Vec<(usize, [GgmlType; 3])> = (0..n_layers).flat_map(|l| candidates(experts.layout(l)).into_iter().map(move |t| (l, t))).collect();
    let mut layers: Vec<Vec<LayerOption>> = (0..n_layers)
        .map(|l| {
            let lay = experts.layout(l);
            vec![LayerOption { types: [lay.gate_ty, lay.up_ty, lay.down_ty], bytes_per_expert: lay.bytes(), kl: 0.0 }]
        })
        .collect();
    let all: Vec<u32> = (0..n_expert as u32).collect();
    for (done, &(l, tys)) in plan.iter().enumerate() {
        let from = experts.layout(l).clone();
        let to = requant_layout(&from, tys)?;
        let mut raw: Vec<Vec<u8>> = vec![Vec::new(); n_expert];
        experts.with_experts(l, &all, &mut |i, b| raw[i] = (0..3).flat_map(|m| b.file_bytes(m).into_owned()).collect())?;
        // Re-quantize the layer's experts on every core (the K-quant searches dominate).
        use rayon::prelude::*;
        let blocks: Vec<ExpertBlock> = raw
            .par_iter()
            .map(|r| {
                let mut data = Vec::new();
                requantize_expert(&from, r, &to, &mut data).map(|_| ExpertBlock::new(data, to.clone()))
            })
            .collect::<Result<_, _>>()?;
        let over = Arc::new(OverrideLayer { inner: experts.clone(), layer: l, layout: to.clone(), blocks });
        // Same dense weights, only the experts' source changes.
        st.session.model.set_experts(over);
        st.session.kv.clear();
        let logits = st.session.forward(&toks, Logits::All)?;
        layers[l].push(LayerOption { types: tys, bytes_per_expert: to.bytes(), kl: mean_kl(&base, &logits, n_vocab) });
        progress(done + 1, plan.len());
    }
    Ok(Sensitivity { n_expert, layers, calibration_tokens: toks.len() })
}

/// Pick one option per layer so the expert bytes fit `target` (greedy: least added KL per byte
/// saved first). Returns the option index per layer.
pub fn choose(s: &Sensitivity, target: u64) -> Result<Vec<usize>, MixedError> {
    let bytes = |l: usize, o: usize| s.layers[l][o].bytes_per_expert as u64 * s.n_expert as u64;
    let mut pick = vec![0usize; s.layers.len()];
    let mut total: u64 = (0..s.layers.len()).map(|l| bytes(l, 0)).sum();
    let min: u64 = s.layers.iter().enumerate().map(|(l, o)| (0..o.len()).map(|i| bytes(l, i)).min().unwrap_or(0)).sum();
    if target < min {
        return Err(MixedError::Unreachable { target, min });
    }
    while total > target {
        let mut best: Option<(f64, usize, usize)> = None;
        for (l, opts) in s.layers.iter().enumerate() {
            let (cb, ck) = (bytes(l, pick[l]), opts[pick[l]].kl);
            for (o, opt) in opts.iter().enumerate() {
                let b = bytes(l, o);
                if b >= cb {
                    continue;
                }
                let cost = (opt.kl - ck) / (cb - b) as f64;
                if best.is_none_or(|(c, _, _)| cost < c) {
                    best = Some((cost, l, o));
                }
            }
        }
        let Some((_, l, o)) = best else { break };
        total = total - bytes(l, pick[l]) + bytes(l, o);
        pick[l] = o;
    }
    Ok(pick)
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType::*;

    fn opt(types: [GgmlType; 3], bytes: usize, kl: f64) -> LayerOption {
        LayerOption { types, bytes_per_expert: bytes, kl }
    }

    #[test]
    fn choose_takes_least_kl_per_byte_until_the_target_fits() {
        // Two layers of 10 experts at 100 bytes; layer 0 loses little per byte, layer 1 a lot.
        let s = Sensitivity {
            n_expert: 10,
            calibration_tokens: 64,
            layers: vec![
                vec![opt([Q4_1; 3], 100, 0.0), opt([Q4_1, Q4_1, Q3K], 80, 0.01), opt([Q4_1, Q4_1, Q2K], 60, 0.05)],
                vec![opt([Q4_1; 3], 100, 0.0), opt([Q4_1, Q4_1, Q3K], 80, 0.5)],
            ],
        };
        // 2000 bytes now; 1800 needs one 20-byte step: layer 0 (0.01 / 200 bytes) beats layer 1.
        assert_eq!(choose(&s, 1800).unwrap(), vec![1, 0]);
        // 1600: layer 0 to Q2_K (0.05 over 400 bytes) is still cheaper per byte than layer 1's step.
        assert_eq!(choose(&s, 1600).unwrap(), vec![2, 0]);
        // 1400 = the smallest reachable.
        assert_eq!(choose(&s, 1400).unwrap(), vec![2, 1]);
        assert!(matches!(choose(&s, 1399), Err(MixedError::Unreachable { min: 1400, .. })));
        // A target above the original keeps everything.
        assert_eq!(choose(&s, 5000).unwrap(), vec![0, 0]);
    }

    #[test]
    fn candidates_respect_block_sizes_and_shrink() {
        // SmolMoE's shape: gate/up rows of 576 (no 256-blocks), down rows of 1536.
        let l = ExpertLayout { n_embd: 576, n_ff: 1536, gate_ty: Q4_1, up_ty: Q4_1, down_ty: Q4_1, gate_bytes: 1536 * 360, up_bytes: 1536 * 360, down_bytes: 576 * 960 };
        let c = candidates(&l);
        assert!(c.contains(&[Q4_1, Q4_1, Q2K]) && c.contains(&[Q4_0, Q4_0, Q3K]) && c.contains(&[Q4_0, Q4_0, Q4_1]));
        for t in &c {
            assert!(t[0] != Q2K && t[0] != Q3K && t[0] != Q4K, "{t:?}: gate rows of 576 cannot hold K-quants");
            assert!(requant_layout(&l, *t).unwrap().bytes() < l.bytes());
        }
        assert!(!c.contains(&[Q4_1, Q4_1, Q4_1]));
    }
}
