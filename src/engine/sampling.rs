//! Token sampling, in the order llama.cpp's common sampler chain applies it
//! (`common/sampling.cpp`): repetition penalty → top-k → top-p → min-p → temperature → draw.
//! Temperature 0 is greedy (argmax).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: usize,
    /// 1.0 = disabled.
    pub top_p: f32,
    /// 0.0 = disabled.
    pub min_p: f32,
    /// 1.0 = disabled.
    pub repeat_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults (`common/common.h`): temp 0.8, top-k 40, top-p 0.95, min-p 0.05,
    /// repeat penalty 1.0 (off), last 64 tokens.
    fn default() -> Self {
        Self { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.0, repeat_last_n: 64, seed: 0 }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }
}

pub struct Sampler {
    pub cfg: SamplerConfig,
    rng: ChaCha8Rng,
    history: Vec<u32>,
}

/// Index of the largest logit (lowest index on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Self { cfg, rng, history: Vec::new() }
    }

    /// Record tokens the model has seen (prompt and output) for the repetition penalty.
    pub fn accept(&mut self, tok: u32) {
        self.history.push(tok);
    }

    /// Tokens recorded so far (see [`Sampler::accept`]).
    pub fn history_len(&self) -> usize {
        self.history.len()
    }

    /// Forget recorded tokens after the first `n` (speculative rollback).
    pub fn truncate_history(&mut self, n: usize) {
        self.history.truncate(n);
    }

    /// Logits after the repetition penalty (the only transform that reads the history).
    fn penalized(&self, logits: &[f32]) -> Vec<f32> {
        let mut l = logits.to_vec();
        // Repetition penalty (CTRL-style, as llama.cpp's `penalties` sampler).
        if self.cfg.repeat_penalty != 1.0 {
            let start = self.history.len().saturating_sub(self.cfg.repeat_last_n);
            let mut seen: Vec<u32> = self.history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = if *x <= 0.0 { *x * self.cfg.repeat_penalty } else { *x / self.cfg.repeat_penalty };
                }
            }
        }
        l
    }

    /// The candidates a draw chooses from and their probabilities, after every transform
    /// (penalty → top-k → top-p → min-p → temperature), sorted by probability, descending.
    /// Greedy (temperature ≤ 0): the argmax with probability 1.
    fn candidates(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let l = self.penalized(logits);
        if self.cfg.temperature <= 0.0 {
            return vec![(argmax(&l), 1.0)];
        }
        // Candidates sorted by logit, descending (ties: lower id first). With top-k, select the
        // k largest first and sort only those (same set and order as sorting everything).
        let mut cand: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.cfg.top_k > 0 && self.cfg.top_k < cand.len() {
            cand.select_nth_unstable_by(self.cfg.top_k - 1, order);
            cand.truncate(self.cfg.top_k);
        }
        cand.sort_by(order);
        let probs = |c: &[(u32, f32)]| -> Vec<f32> {
            let m = c[0].1;
            let e: Vec<f32> = c.iter().map(|x| (x.1 - m).exp()).collect();
            let s: f32 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        };
        if self.cfg.top_p < 1.0 {
            let p = probs(&cand);
            let mut cum = 0.0;
            let mut keep = cand.len();
            for (i, &pi) in p.iter().enumerate() {
                cum += pi;
                if cum >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if self.cfg.min_p > 0.0 {
            let p = probs(&cand);
            let thr = p[0] * self.cfg.min_p;
            let keep = p.iter().take_while(|&&x| x >= thr).count().max(1);
            cand.truncate(keep);
        }
        for c in cand.iter_mut() {
            c.1 /= self.cfg.temperature;
        }
        let p = probs(&cand);
        cand.iter().zip(p).map(|(c, p)| (c.0, p)).collect()
    }

    /// The distribution a draw from `logits` follows, over the whole vocabulary (`logits.len()`
    /// values summing to 1; greedy: one-hot at the argmax). Speculative sampling compares the
    /// target's and the draft's distributions after the same transforms with it.
    pub fn probs(&self, logits: &[f32]) -> Vec<f32> {
        let mut p = vec![0f32; logits.len()];
        for (t, pt) in self.candidates(logits) {
            p[t as usize] = pt;
        }
        p
    }

    /// A uniform draw in [0, 1) from this sampler's generator.
    pub fn uniform(&mut self) -> f32 {
        self.rng.random()
    }

    /// Draw a token from a probability vector (need not be normalised; all zero: the argmax).
    pub fn sample_probs(&mut self, p: &[f32]) -> u32 {
        let total: f64 = p.iter().map(|&x| x as f64).sum();
        if total <= 0.0 {
            return argmax(p);
        }
        let r = self.rng.random::<f64>() * total;
        let mut cum = 0.0f64;
        let mut last = 0;
        for (i, &pi) in p.iter().enumerate() {
            if pi > 0.0 {
                cum += pi as f64;
                last = i;
                if r < cum {
                    return i as u32;
                }
            }
        }
        last as u32
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let cand = self.candidates(logits);
        if self.cfg.temperature <= 0.0 {
            return cand[0].0;
        }
        let r: f32 = self.rng.random();
        let mut cum = 0.0;
        for &(t, pi) in &cand {
            cum += pi;
            if r < cum {
                return t;
            }
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.9]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplerConfig { temperature: 5.0, top_k: 1, ..Default::default() });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.9]), 1);
        }
    }

    #[test]
    fn repetition_penalty_changes_choice() {
        let mut s = Sampler::new(SamplerConfig { repeat_penalty: 2.0, ..SamplerConfig::greedy() });
        s.accept(1);
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.9]), 3);
    }

    #[test]
    fn same_seed_same_draws() {
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7, ..Default::default() };
        let logits = [0.5f32, 0.4, 0.3, 0.2, 0.1];
        let a: Vec<u32> = { let mut s = Sampler::new(cfg.clone()); (0..50).map(|_| s.sample(&logits)).collect() };
        let b: Vec<u32> = { let mut s = Sampler::new(cfg); (0..50).map(|_| s.sample(&logits)).collect() };
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "sampling at temperature 1 should vary");
    }

    #[test]
    fn probs_match_the_transforms() {
        let logits = [2.0f32, 1.0, 0.5, -3.0, 1.5];
        // Greedy: one-hot at the argmax.
        let s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.probs(&logits), vec![1.0, 0.0, 0.0, 0.0, 0.0]);
        // Top-k 2 at temperature 1: softmax over the two largest logits, zero elsewhere.
        let s = Sampler::new(SamplerConfig { temperature: 1.0, top_k: 2, top_p: 1.0, min_p: 0.0, ..Default::default() });
        let p = s.probs(&logits);
        let z = 1.0 + (-0.5f32).exp();
        assert!((p[0] - 1.0 / z).abs() < 1e-6 && (p[4] - (-0.5f32).exp() / z).abs() < 1e-6);
        assert_eq!((p[1], p[2], p[3]), (0.0, 0.0, 0.0));
        // Draws follow probs (same transforms): empirical frequencies within 3 sigma.
        let cfg = SamplerConfig { temperature: 0.7, top_k: 3, top_p: 1.0, min_p: 0.0, seed: 3, ..Default::default() };
        let mut s = Sampler::new(cfg);
        let p = s.probs(&logits);
        let n = 20000;
        let mut c = [0usize; 5];
        for _ in 0..n {
            c[s.sample(&logits) as usize] += 1;
        }
        for i in 0..5 {
            let sd = (p[i] as f64 * (1.0 - p[i] as f64) / n as f64).sqrt();
            assert!((c[i] as f64 / n as f64 - p[i] as f64).abs() <= 3.0 * sd + 1e-9, "token {i}: {} vs {}", c[i], p[i]);
        }
    }
}
