//! Quality measurement: perplexity of a text, and the KL divergence of a model's next-token
//! distributions from a base model's, as llama.cpp's `llama-perplexity` computes them
//! (tools/perplexity/perplexity.cpp): the tokenized text is cut into chunks of `n_ctx` tokens,
//! each chunk is evaluated from an empty KV cache (its first token replaced by BOS when the
//! vocabulary adds one), and only the second half of each chunk is scored, so every scored token
//! has at least `n_ctx / 2` tokens of context. PPL = exp(mean negative log-likelihood);
//! KL(base ‖ model) = Σ p_base · (log p_base − log p_model), averaged over scored positions.

use super::{EngineError, Session};
use crate::model::Logits;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PplReport {
    pub n_ctx: usize,
    pub chunks: usize,
    /// Tokens scored (n_ctx/2 - 1 per chunk... see the module comment).
    pub scored: usize,
    /// Mean negative log-likelihood (nats per token).
    pub nll: f64,
    pub ppl: f64,
    /// Mean KL(base ‖ model) in nats per token (with a base model).
    pub kl: Option<f64>,
    /// Fraction of scored positions where the model's argmax equals the base's.
    pub same_top: Option<f64>,
    /// Perplexity of the base model on the same tokens.
    pub base_ppl: Option<f64>,
}

/// log-softmax of `logits` (max-subtracted, summed in f64).
pub(crate) fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

fn argmax(v: &[f64]) -> usize {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b
}

/// Perplexity of `text` under `model` (and KL from `base` when given; both must share the
/// tokenizer). `n_ctx` must be at least 4 and at most the sessions' context size.
pub fn perplexity(model: &mut Session, mut base: Option<&mut Session>, text: &str, n_ctx: usize) -> Result<PplReport, EngineError> {
    let n_ctx = n_ctx.max(4);
    if n_ctx > model.kv.n_ctx || base.as_ref().is_some_and(|b| n_ctx > b.kv.n_ctx) {
        return Err(EngineError::PromptTooLong(n_ctx, model.kv.n_ctx));
    }
    let tokens = model.tokenizer.encode(text, true, false);
    let chunks = tokens.len() / n_ctx;
    if chunks == 0 {
        return Err(EngineError::PromptTooLong(tokens.len(), n_ctx));
    }
    let bos = if model.tokenizer.add_bos() { model.tokenizer.bos() } else { None };
    let first = n_ctx / 2;
    let (mut nll, mut nll_base, mut kl, mut same, mut scored) = (0f64, 0f64, 0f64, 0usize, 0usize);
    for c in 0..chunks {
        let start = c * n_ctx;
        let mut batch = tokens[start..start + n_ctx].to_vec();
        if let Some(b) = bos {
            batch[0] = b;
        }
        let lm = run_all(model, &batch)?;
        let lb = match base.as_deref_mut() {
            Some(b) => Some(run_all(b, &batch)?),
            None => None,
        };
        let nv = lm.len() / n_ctx;
        for j in first..n_ctx - 1 {
            let next = tokens[start + j + 1] as usize;
            let pm = log_softmax(&lm[j * nv..(j + 1) * nv]);
            nll -= pm[next];
            if let Some(lb) = &lb {
                let pb = log_softmax(&lb[j * nv..(j + 1) * nv]);
                nll_base -= pb[next];
                kl += pb.iter().zip(&pm).map(|(&b, &m)| b.exp() * (b - m)).sum::<f64>();
                same += (argmax(&pb) == argmax(&pm)) as usize;
            }
            scored += 1;
        }
    }
    let n = scored.max(1) as f64;
    let has_base = base.is_some();
    Ok(PplReport {
        n_ctx,
        chunks,
        scored,
        nll: nll / n,
        ppl: (nll / n).exp(),
        kl: has_base.then_some(kl / n),
        same_top: has_base.then_some(same as f64 / n),
        base_ppl: has_base.then_some((nll_base / n).exp()),
    })
}

/// Logits of every position of `batch` from an empty cache, in the session's prefill batches.
fn run_all(s: &mut Session, batch: &[u32]) -> Result<Vec<f32>, EngineError> {
    s.kv.clear();
    let step = if s.prefill_batch == 0 { batch.len() } else { s.prefill_batch };
    let mut out = Vec::new();
    for ch in batch.chunks(step) {
        out.extend(s.forward(ch, Logits::All)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::log_softmax;

    #[test]
    fn log_softmax_normalises() {
        let l = log_softmax(&[1.0, 2.0, 3.0]);
        let s: f64 = l.iter().map(|v| v.exp()).sum();
        assert!((s - 1.0).abs() < 1e-12);
        assert!((l[2] - l[1] - 1.0).abs() < 1e-12);
    }
}
