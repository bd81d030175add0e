//! Speculative decoding: a cheap draft proposes up to γ tokens, the target verifies them all in
//! one batched forward (`[last, d1..dγ]` with `Logits::All`, rows computed per row) and keeps the longest accepted prefix
//! plus one token of its own; the target's KV cache (and a draft model's) is rolled back past the
//! first rejected token.
//!
//! With a MoE target each layer of the verification forward loads the union of the experts the
//! γ+1 tokens route to once (`Model::moe` takes the union per batch), so a streamed target reads an
//! expert once per verification instead of once per token that uses it.
//!
//! Draft sources ([`Draft`]): a smaller model sharing the tokenizer ([`DraftModel`], with its own
//! KV cache re-synchronised to the committed tokens before each proposal) and prompt lookup
//! ([`PromptLookup`], n-gram matches over prompt + generated tokens, deterministic).
//!
//! Verification:
//! - greedy (temperature 0): a draft token is accepted when it equals the target's greedy choice
//!   at its position; the output is exactly the target's plain greedy output: the prompt and the
//!   first token are computed as plain decoding computes them, and verification forwards use
//!   [`crate::model::Model::forward_per_row`], whose rows are bit-identical to single-token
//!   forwards (plain batches use llama.cpp's batch kernels, which sum in other orders; see
//!   `tests/suite/speculative.rs`).
//! - sampling: speculative sampling (Leviathan et al. 2023; Chen et al. 2023). With p and q the
//!   target's and the draft's distributions after the same sampler transforms
//!   ([`Sampler::probs`]), draft token x is accepted with probability min(1, p(x)/q(x)); on
//!   rejection the token is drawn from norm(max(0, p − q)); after γ acceptances a bonus token is
//!   drawn from p. Prompt-lookup drafts are deterministic (q one-hot): acceptance p(x), residual p
//!   without x. The output distribution equals the target's.

use super::sampling::{Sampler, SamplerConfig};
use super::{now_ms, EngineError, GenStats, Session, Utf8Stream};
use crate::gguf::GgufFile;
use crate::model::{ExpertMode, KvCache, Logits, Model};
use crate::store::ByteSource;
use crate::tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the draft model's vocabulary differs from the target's: {0}")]
    VocabMismatch(String),
    #[error("{0} is not supported")]
    Unsupported(&'static str),
}

impl From<crate::model::ModelError> for SpecError {
    fn from(e: crate::model::ModelError) -> Self {
        SpecError::Engine(e.into())
    }
}

/// Proposed tokens and, for a draft that samples, the distribution each was drawn from.
#[derive(Clone, Debug, Default)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// `q[i]`: the draft's distribution (full vocabulary, after the sampler's transforms) that
    /// `tokens[i]` was drawn from. `None`: deterministic drafts (q one-hot at the token).
    pub q: Option<Vec<Vec<f32>>>,
}

/// A source of draft tokens.
pub trait Draft {
    fn name(&self) -> &'static str;
    /// A generation starts with this sampler configuration.
    fn start(&mut self, _sampler: &SamplerConfig) {}
    /// The prompt is known (prompt processing, counted in prompt time): every prompt token but
    /// the last, which arrives with the first `propose`.
    fn prefill(&mut self, _prompt: &[u32]) -> Result<(), EngineError> {
        Ok(())
    }
    /// Propose up to `max` tokens continuing `ctx` (every committed token: prompt + output);
    /// `target`: the model being verified (a multi-token-prediction block lives in it).
    fn propose(&mut self, target: &Model, ctx: &[u32], max: usize) -> Result<Proposal, EngineError>;
    /// Whether the draft reads the target's output-normed hidden states ([`Self::hidden`]).
    fn wants_hidden(&self) -> bool {
        false
    }
    /// The target's output-normed hidden states (`rows × n_embd`) of `tokens` at positions
    /// `pos0..` from its latest forward (rows of rejected drafts included: the next forward from
    /// their position replaces them).
    fn hidden(&mut self, _pos0: usize, _tokens: &[u32], _rows: &[f32]) {}
    /// Forward passes the draft ran since `start`.
    fn forwards(&self) -> u64 {
        0
    }
    /// A streamed target's expert source: a draft with hidden states of the target's shape
    /// passes its per-layer FFN inputs (residual stream before `ffn_norm`) for the coming
    /// verification's rows `[last, d1..dγ-1]` on after each of its forwards
    /// ([`ExpertSource::on_draft_hidden`]), so the verification's experts load while the draft
    /// still computes.
    fn set_lookahead(&mut self, _target: Option<std::sync::Arc<dyn crate::expert::ExpertSource>>, _n_embd: usize, _n_layer: usize) {}
}

/// A dense (or any) model sharing the target's tokenizer, with its own KV cache.
pub struct DraftModel {
    pub model: Model,
    pub kv: KvCache,
    /// Tokens whose keys and values are in `kv` (position order).
    kv_tokens: Vec<u32>,
    sampler: Sampler,
    forwards: u64,
    /// Weight bytes (for memory accounting against a budget).
    pub bytes: u64,
    /// The target's expert source, when it shares this model's shape.
    lookahead: Option<std::sync::Arc<dyn crate::expert::ExpertSource>>,
    /// Per-layer FFN inputs of the current proposal's forwards (one row per forward).
    rows: Vec<Vec<f32>>,
}

/// First difference between two vocabularies, or `None` when identical.
pub fn vocab_difference(target: &Tokenizer, draft: &Tokenizer) -> Option<String> {
    if target.n_vocab() != draft.n_vocab() {
        return Some(format!("{} tokens in the target, {} in the draft", target.n_vocab(), draft.n_vocab()));
    }
    for i in 0..target.n_vocab() as u32 {
        if target.token_text(i) != draft.token_text(i) {
            return Some(format!("token {i} is {:?} in the target, {:?} in the draft", target.token_text(i), draft.token_text(i)));
        }
    }
    if target.eog_ids() != draft.eog_ids() {
        return Some(format!("end-of-generation tokens {:?} vs {:?}", target.eog_ids(), draft.eog_ids()));
    }
    None
}

/// A draft's sampler for a generation with `sampler`: the same transforms with its own
/// generator (draft draws must be independent of the target's acceptance draws).
pub(crate) fn draft_sampler(sampler: &SamplerConfig) -> Sampler {
    Sampler::new(SamplerConfig { seed: sampler.seed ^ 0x9E37_79B9_7F4A_7C15, ..sampler.clone() })
}

/// The sampler's history for a proposal: the committed tokens its repetition penalty looks at.
pub(crate) fn reset_history(sampler: &mut Sampler, ctx: &[u32]) {
    sampler.truncate_history(0);
    for &t in &ctx[ctx.len().saturating_sub(sampler.cfg.repeat_last_n.max(1))..] {
        sampler.accept(t);
    }
}

/// The next draft token from `logits`: the sampler's greedy choice, or a draw whose distribution
/// goes to `p.q`; appended to `p` and to the sampler's history.
pub(crate) fn draw(sampler: &mut Sampler, logits: &[f32], p: &mut Proposal) -> u32 {
    let d = match p.q.as_mut() {
        None => sampler.sample(logits),
        Some(qs) => {
            let q = sampler.probs(logits);
            let d = sampler.sample_probs(&q);
            qs.push(q);
            d
        }
    };
    p.tokens.push(d);
    sampler.accept(d);
    d
}

/// An empty proposal for `max` tokens (with room for distributions when the sampler samples).
pub(crate) fn proposal(sampler: &Sampler, max: usize) -> Proposal {
    let greedy = sampler.cfg.temperature <= 0.0;
    Proposal { tokens: Vec::with_capacity(max), q: if greedy { None } else { Some(Vec::with_capacity(max)) } }
}

impl DraftModel {
    /// Keep the last captured row per layer of the forward just run (the `n`-th row of this
    /// proposal) and pass the rows so far to the target's expert source.
    fn pass_on(&mut self, n: usize) {
        let Some(target) = self.lookahead.clone() else { return };
        let e = self.model.cfg.n_embd;
        let cap = self.model.take_captured();
        if self.rows.len() != cap.len() {
            self.rows = vec![Vec::new(); cap.len()];
        }
        for (r, c) in self.rows.iter_mut().zip(&cap) {
            if c.len() >= e {
                r.extend_from_slice(&c[c.len() - e..]);
            }
            r.truncate(n * e);
        }
        target.on_draft_hidden(&self.rows);
    }

    /// Load a draft model (all weights resident) for `target`; the vocabularies must be identical.
    pub fn load(src: &dyn ByteSource, target: &Tokenizer, n_ctx: usize) -> Result<Self, SpecError> {
        let g = GgufFile::read(src).map_err(EngineError::from)?;
        let tok = Tokenizer::from_gguf(&g).map_err(EngineError::from)?;
        if let Some(why) = vocab_difference(target, &tok) {
            return Err(SpecError::VocabMismatch(why));
        }
        let model = Model::load(src, &g, ExpertMode::Resident)?;
        if model.cfg.n_vocab != target.n_vocab() {
            return Err(SpecError::VocabMismatch(format!("output rows {} vs {} tokens", model.cfg.n_vocab, target.n_vocab())));
        }
        let kv = model.new_kv(n_ctx.min(model.cfg.n_ctx_train.max(1)))?;
        let bytes = g.tensors.iter().map(|t| t.size).sum();
        Ok(Self { model, kv, kv_tokens: Vec::new(), sampler: Sampler::new(SamplerConfig::greedy()), forwards: 0, bytes, lookahead: None, rows: Vec::new() })
    }

    /// Bytes of the draft's KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.kv.kv_bytes()
    }

    /// Feed `toks` (positions `kv.len ..`), returning the last position's logits.
    fn feed(&mut self, toks: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut logits = Vec::new();
        for c in toks.chunks(64) {
            logits = self.model.forward(c, &mut self.kv, Logits::Last)?;
            self.forwards += 1;
        }
        self.kv_tokens.extend_from_slice(toks);
        Ok(logits)
    }
}

impl Draft for DraftModel {
    fn name(&self) -> &'static str {
        "draft model"
    }

    fn start(&mut self, sampler: &SamplerConfig) {
        self.sampler = draft_sampler(sampler);
        self.forwards = 0;
    }

    fn prefill(&mut self, prompt: &[u32]) -> Result<(), EngineError> {
        let n = prompt.len().min(self.kv.n_ctx);
        // Keep the common prefix with what the draft's cache holds (a conversation's earlier turns).
        let common = super::common_prefix(&self.kv_tokens, &prompt[..n]).min(self.kv.len);
        let common = if common == 0 {
            self.kv.clear();
            0
        } else {
            self.kv.truncate(common)
        };
        self.kv_tokens.truncate(common);
        if n > common {
            self.feed(&prompt[common..n])?;
        }
        Ok(())
    }

    fn propose(&mut self, _target: &Model, ctx: &[u32], max: usize) -> Result<Proposal, EngineError> {
        if max == 0 || ctx.is_empty() {
            return Ok(Proposal::default());
        }
        // Room in the draft's context: after proposing, its KV holds ctx + max - 1 tokens.
        let max = max.min((self.kv.n_ctx + 1).saturating_sub(ctx.len()));
        if max == 0 {
            return Ok(Proposal::default());
        }
        // Roll back to the longest common prefix with the committed tokens (at least one token
        // must be fed to get logits), then catch up.
        let common = super::common_prefix(&self.kv_tokens, ctx).min(ctx.len() - 1);
        let common = self.kv.truncate(common);
        self.kv_tokens.truncate(common);
        self.model.take_captured();
        self.rows.clear();
        let mut logits = self.feed(&ctx[common..])?;
        // The drafts after here are cut back next round: a recurrent draft comes back here.
        self.kv.checkpoint();
        self.pass_on(1);
        // Sampler history: the committed tokens the repetition penalty looks at, then the drafts.
        reset_history(&mut self.sampler, ctx);
        let mut p = proposal(&self.sampler, max);
        for i in 0..max {
            let d = draw(&mut self.sampler, &logits, &mut p);
            if i + 1 < max {
                logits = self.feed(&[d])?;
                self.pass_on(i + 2);
            }
        }
        Ok(p)
    }

    fn forwards(&self) -> u64 {
        self.forwards
    }

    fn set_lookahead(&mut self, target: Option<std::sync::Arc<dyn crate::expert::ExpertSource>>, n_embd: usize, n_layer: usize) {
        // Only a draft of the target's shape shares its hidden space.
        self.lookahead = target.filter(|_| n_embd == self.model.cfg.n_embd && n_layer == self.model.cfg.n_layer);
        // Record hidden states only while someone uses them.
        self.model.set_capture(self.lookahead.is_some());
    }
}

/// Prompt lookup decoding (n-gram drafts from the context itself), after llama.cpp's `lookup`
/// example: the longest suffix n-gram (n from `ngram_max` down to `ngram_min`) of the context
/// plus drafts so far is looked up in that same sequence; the continuation seen most often after
/// it becomes the next draft token if it was seen at least `min_count[n-1]` times and makes up at
/// least `min_percent[n-1]`% of the continuations (llama.cpp's "lax" context-cache thresholds);
/// drafting stops at the first n-gram without a confident continuation.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    pub ngram_min: usize,
    pub ngram_max: usize,
    pub min_count: [u32; 4],
    pub min_percent: [u32; 4],
}

impl Default for PromptLookup {
    /// llama.cpp: `LLAMA_NGRAM_MIN` 1, `LLAMA_NGRAM_MAX` 4, `draft_min_sample_size_lax`
    /// {2, 2, 1, 1}, `draft_min_percent_lax` {66, 50, 50, 50}.
    fn default() -> Self {
        Self { ngram_min: 1, ngram_max: 4, min_count: [2, 2, 1, 1], min_percent: [66, 50, 50, 50] }
    }
}

/// llama.cpp's default maximum draft length for `lookup` (`params.speculative.n_max`).
pub const LOOKUP_DRAFT_MAX: usize = 16;
/// Default γ with a draft model.
pub const DRAFT_MODEL_DRAFT_MAX: usize = 4;

impl PromptLookup {
    /// Up to `max` draft tokens continuing `ctx`.
    pub fn draft(&self, ctx: &[u32], max: usize) -> Proposal {
        let mut seq = ctx.to_vec();
        let mut p = Proposal::default();
        while p.tokens.len() < max {
            match self.next(&seq) {
                Some(t) => {
                    p.tokens.push(t);
                    seq.push(t);
                }
                None => break,
            }
        }
        p
    }

    /// The next draft token after `seq`, if some n-gram suffix predicts one confidently.
    pub fn next(&self, seq: &[u32]) -> Option<u32> {
        let hi = self.ngram_max.min(4);
        for n in (self.ngram_min.max(1)..=hi).rev() {
            if seq.len() <= n {
                continue;
            }
            let suffix = &seq[seq.len() - n..];
            let mut counts: Vec<(u32, u32)> = Vec::new();
            let mut total = 0u32;
            for j in 0..seq.len() - n {
                if &seq[j..j + n] == suffix {
                    let t = seq[j + n];
                    match counts.iter_mut().find(|c| c.0 == t) {
                        Some(c) => c.1 += 1,
                        None => counts.push((t, 1)),
                    }
                    total += 1;
                }
            }
            // Most frequent continuation; ties go to the one seen first.
            let Some(&(tok, c)) = counts.iter().fold(None, |b: Option<&(u32, u32)>, x| match b {
                Some(y) if y.1 >= x.1 => Some(y),
                _ => Some(x),
            }) else {
                continue;
            };
            if c >= self.min_count[n - 1] && 100 * c >= self.min_percent[n - 1] * total {
                return Some(tok);
            }
        }
        None
    }
}

impl Draft for PromptLookup {
    fn name(&self) -> &'static str {
        "prompt lookup"
    }

    fn propose(&mut self, _target: &Model, ctx: &[u32], max: usize) -> Result<Proposal, EngineError> {
        Ok(self.draft(ctx, max))
    }
}

/// Counters of one speculative generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SpecStats {
    pub source: String,
    /// Draft tokens proposed and accepted.
    pub drafted: u64,
    pub accepted: u64,
    /// Target forward passes during decoding (one per verification round).
    pub target_forwards: u64,
    pub draft_forwards: u64,
    pub gen_tokens: u64,
    /// Expert loads (demand + prefetch) and bytes read during decoding (after the prompt), when
    /// the caller gave an I/O probe (a streamed target).
    pub expert_loads: Option<u64>,
    pub bytes_read: Option<u64>,
}

impl SpecStats {
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
    /// Output tokens per target forward pass.
    pub fn tokens_per_forward(&self) -> f64 {
        self.gen_tokens as f64 / self.target_forwards.max(1) as f64
    }
    /// Experts loaded per accepted (output) token.
    pub fn experts_per_token(&self) -> Option<f64> {
        self.expert_loads.map(|l| l as f64 / self.gen_tokens.max(1) as f64)
    }
    /// MB (10^6 bytes) read per accepted (output) token.
    pub fn mb_per_token(&self) -> Option<f64> {
        self.bytes_read.map(|b| b as f64 / 1e6 / self.gen_tokens.max(1) as f64)
    }
    /// What a reply reports of its drafts (`les serve`'s `les.draft`, the C ABI's `last.draft`):
    /// source, tokens drafted and accepted, target forwards.
    pub fn summary_json(&self) -> serde_json::Value {
        serde_json::json!({ "source": self.source, "drafted": self.drafted, "accepted": self.accepted, "target_forwards": self.target_forwards })
    }
    /// One line for the CLI.
    pub fn line(&self) -> String {
        let mut s = format!(
            "speculative ({}): drafted {}, accepted {} ({:.1}%) | {} target forwards, {:.2} tokens/forward",
            self.source,
            self.drafted,
            self.accepted,
            100.0 * self.acceptance_rate(),
            self.target_forwards,
            self.tokens_per_forward()
        );
        if let (Some(e), Some(m)) = (self.experts_per_token(), self.mb_per_token()) {
            s += &format!(" | {e:.1} experts loaded, {m:.2} MB read per accepted token");
        }
        s
    }
}

/// Counts of expert loads and bytes read so far (a streamed target's statistics).
pub type IoProbe<'a> = &'a dyn Fn() -> (u64, u64);

/// Options of one speculative generation.
pub struct SpecOptions<'a> {
    /// γ: most draft tokens verified per target forward.
    pub draft_max: usize,
    /// Expert I/O counters to sample after the prompt and at the end.
    pub io: Option<IoProbe<'a>>,
    /// `false` (the default use): the prompt runs exactly as plain decoding runs it and the first
    /// output token is sampled from its logits, so greedy output equals plain greedy bit for bit.
    /// `true`: the last prompt token is fed with the first drafts instead, so the first output
    /// token goes through verification too (used to test the speculative-sampling math on a
    /// token whose target distribution is known; its logits then come from the per-row kernels,
    /// which can differ from the batch kernels in the last bits).
    pub verify_first: bool,
}

/// The body of [`generate`].
#[allow(clippy::too_many_arguments)]
fn generate_inner<'d>(
    sess: &mut Session,
    mut draft: Option<&mut (dyn Draft + 'd)>,
    opts: &SpecOptions<'_>,
    prompt: &[u32],
    n: usize,
    sampler: &SamplerConfig,
    ignore_eos: bool,
    on_token: &mut dyn FnMut(u32, &str) -> bool,
) -> Result<(Vec<u32>, GenStats, SpecStats), SpecError> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt.into());
    }
    if prompt.len() >= sess.kv.n_ctx {
        return Err(EngineError::PromptTooLong(prompt.len(), sess.kv.n_ctx).into());
    }
    // The cache's common prefix with the prompt is kept (when the session reuses prefixes); the
    // head below is what still has to run.
    let reused = sess.reuse(&prompt[..prompt.len() - usize::from(opts.verify_first)]);
    let mut s = Sampler::new(sampler.clone());
    for &t in prompt {
        s.accept(t);
    }
    let mut spec = SpecStats { source: draft.as_ref().map(|d| d.name()).unwrap_or("none").to_string(), ..Default::default() };
    let mut stats = GenStats { prompt_tokens: prompt.len(), prompt_reused: reused, ..Default::default() };
    let t0 = now_ms();
    // The prompt exactly as plain decoding runs it (same batches, same kernels), and the first
    // output token from its logits; verification forwards then compute every row as a single-token
    // forward would (`forward_per_row`), so greedy output equals plain greedy bit for bit.
    let head = if opts.verify_first { &prompt[..prompt.len() - 1] } else { prompt };
    // A draft that reads the target's hidden states (MTP) gets each forward's rows.
    let want_h = draft.as_ref().is_some_and(|d| d.wants_hidden());
    sess.model.set_record_hidden(want_h);
    let first = if head.len() <= reused { Vec::new() } else { sess.prefill(&head[reused..])? };
    if let Some(d) = draft.as_mut() {
        d.start(sampler);
        d.prefill(head)?;
        if want_h {
            d.hidden(reused, &head[reused.min(head.len())..], &sess.model.take_hidden());
        }
    }
    stats.prompt_ms = now_ms() - t0;
    let io0 = opts.io.map(|f| f());
    let t1 = now_ms();
    let n_ctx = sess.kv.n_ctx;
    let mut toks: Vec<u32> = prompt.to_vec();
    let mut out: Vec<u32> = Vec::new();
    let mut utf8 = Utf8Stream::default();
    // Commit one token; false when generation must stop.
    let mut commit = |tk: &crate::tokenizer::Tokenizer, t: u32, toks: &mut Vec<u32>, out: &mut Vec<u32>, s: &mut Sampler| -> bool {
        if !ignore_eos && tk.is_eog(t) {
            return false;
        }
        out.push(t);
        toks.push(t);
        s.accept(t);
        let text = utf8.push(&tk.token_to_piece(t, false));
        on_token(t, &text) && out.len() < n && toks.len() < n_ctx
    };
    let mut going = n > 0;
    if going && !opts.verify_first {
        let t = s.sample(&first);
        going = commit(&sess.tokenizer, t, &mut toks, &mut out, &mut s);
    }
    let greedy = sampler.temperature <= 0.0;
    while going {
        // The target's KV holds toks[..len-1]; the last committed token is fed with the drafts.
        let room = (n - out.len()).min(n_ctx - toks.len());
        let gamma = opts.draft_max.min(room.saturating_sub(1));
        let prop = match draft.as_mut() {
            Some(d) if gamma > 0 => d.propose(&sess.model, &toks, gamma)?,
            _ => Proposal::default(),
        };
        let d = &prop.tokens[..prop.tokens.len().min(gamma)];
        let mut batch = Vec::with_capacity(d.len() + 1);
        batch.push(*toks.last().unwrap());
        batch.extend_from_slice(d);
        let base = sess.kv.len;
        // Recurrent layers cannot be cut back to an accepted prefix: save their state here.
        if !d.is_empty() {
            sess.kv.checkpoint();
        }
        let logits = sess.forward_per_row(&batch, Logits::All)?;
        if let Some(d) = draft.as_mut().filter(|_| want_h) {
            d.hidden(base, &batch, &sess.model.take_hidden());
        }
        spec.target_forwards += 1;
        spec.drafted += d.len() as u64;
        let nv = logits.len() / batch.len();
        let h0 = s.history_len();
        let mut new = Vec::with_capacity(batch.len());
        for i in 0..=d.len() {
            let row = &logits[i * nv..(i + 1) * nv];
            if i == d.len() {
                new.push(s.sample(row));
                break;
            }
            let x = d[i];
            let t = if greedy {
                s.sample(row)
            } else {
                let p = s.probs(row);
                let px = p.get(x as usize).copied().unwrap_or(0.0);
                let q = prop.q.as_ref().map(|q| &q[i]);
                let a = match q {
                    Some(q) => {
                        let qx = q.get(x as usize).copied().unwrap_or(0.0);
                        if qx <= 0.0 { 1.0 } else { (px / qx).min(1.0) }
                    }
                    None => px,
                };
                if s.uniform() < a {
                    x
                } else {
                    // Residual norm(max(0, p − q)); q one-hot: p without x.
                    let mut r = p;
                    match q {
                        Some(q) => r.iter_mut().zip(q).for_each(|(a, &b)| *a = (*a - b).max(0.0)),
                        None => r[x as usize] = 0.0,
                    }
                    // A residual that rounds to nothing (p = q up to rounding): keep x.
                    if r.iter().all(|&v| v <= 0.0) { x } else { s.sample_probs(&r) }
                }
            };
            new.push(t);
            if t != x {
                break;
            }
            s.accept(t);
        }
        s.truncate_history(h0);
        let k = new.len() - 1; // accepted drafts
        spec.accepted += k as u64;
        let kept = sess.kv.truncate(base + 1 + k);
        if kept < base + 1 + k {
            // Back at the checkpoint (recurrent layers): run the accepted tokens again, row by
            // row as verification did, so the state is the one plain decoding reaches.
            sess.forward_per_row(&batch[kept - base..1 + k], Logits::Last)?;
            if let Some(d) = draft.as_mut().filter(|_| want_h) {
                d.hidden(kept, &batch[kept - base..1 + k], &sess.model.take_hidden());
            }
        }
        for &t in &new {
            if !commit(&sess.tokenizer, t, &mut toks, &mut out, &mut s) {
                going = false;
                break;
            }
        }
    }
    let rest = utf8.finish();
    if !rest.is_empty() {
        on_token(u32::MAX, &rest);
    }
    stats.gen_tokens = out.len();
    stats.finish_reason = Some(if out.len() >= n || toks.len() >= n_ctx { super::FinishReason::Length } else { super::FinishReason::Stop });
    stats.gen_ms = now_ms() - t1;
    spec.gen_tokens = out.len() as u64;
    spec.draft_forwards = draft.as_ref().map(|d| d.forwards()).unwrap_or(0);
    if let (Some(f), Some((l0, b0))) = (opts.io, io0) {
        let (l1, b1) = f();
        spec.expert_loads = Some(l1 - l0);
        spec.bytes_read = Some(b1 - b0);
    }
    Ok((out, stats, spec))
}

/// Like [`Session::generate`], with drafts from `draft` (`None`: plain decoding, one target
/// forward per token, through the same loop).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    sess: &mut Session,
    mut draft: Option<&mut dyn Draft>,
    opts: &SpecOptions<'_>,
    prompt: &[u32],
    n: usize,
    sampler: &SamplerConfig,
    ignore_eos: bool,
    on_token: &mut dyn FnMut(u32, &str) -> bool,
) -> Result<(Vec<u32>, GenStats, SpecStats), SpecError> {
    // A draft with hidden states of the target's shape feeds the target's expert scheduler
    // while it proposes (for this generation only).
    let (ex, e, l) = (sess.model.experts().cloned(), sess.model.cfg.n_embd, sess.model.cfg.n_layer);
    if let Some(d) = draft.as_mut() {
        d.set_lookahead(ex, e, l);
    }
    let r = generate_inner(sess, draft.as_deref_mut(), opts, prompt, n, sampler, ignore_eos, on_token);
    sess.model.set_record_hidden(false);
    if let Some(d) = draft.as_mut() {
        d.set_lookahead(None, e, l);
    }
    r
}

/// [`generate`] with a generation's options as [`Session::generate_with`] takes them: stop
/// strings apply to the text as it does (held back across tokens, cut off with what follows;
/// `on_text` also sees empty pieces, so it can stop a generation whose text is held back). A
/// context shift is not supported: generation ends when the context is full.
pub fn generate_with(
    sess: &mut Session,
    draft: Option<&mut dyn Draft>,
    opts: &SpecOptions<'_>,
    prompt: &[u32],
    o: &super::GenOptions,
    on_text: &mut dyn FnMut(u32, &str) -> bool,
) -> Result<(Vec<u32>, GenStats, SpecStats), SpecError> {
    if matches!(o.context, super::ContextMode::Shift { .. }) {
        return Err(SpecError::Unsupported("a context shift with speculative decoding"));
    }
    let mut stops = super::StopStrings::new(&o.stop);
    let mut cb = |t: u32, piece: &str| {
        if stops.stopped() {
            return false;
        }
        let (text, hit) = stops.push(piece.to_string());
        let go = on_text(t, &text);
        go && !hit
    };
    let (ids, mut st, sp) = generate(sess, draft, opts, prompt, o.n, &o.sampler, o.ignore_eos, &mut cb)?;
    let (rest, hit) = stops.finish(String::new());
    if !rest.is_empty() {
        on_text(u32::MAX, &rest);
    }
    if hit {
        st.finish_reason = Some(super::FinishReason::Stop);
    }
    Ok((ids, st, sp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_follows_repeated_ngrams() {
        let l = PromptLookup::default();
        // "1 2 3 4 ... 1 2 3" → 4 (4-gram-less match: 3-gram "1 2 3" seen once, followed by 4).
        let seq = [1, 2, 3, 4, 9, 1, 2, 3];
        assert_eq!(l.next(&seq), Some(4));
        let d = l.clone();
        let p = d.draft(&seq, 3);
        assert_eq!(p.tokens, vec![4, 9, 1]);
        assert!(p.q.is_none());
        // Nothing repeats: no draft.
        assert_eq!(l.next(&[5, 6, 7, 8]), None);
        // A unigram needs two sightings with a 66% majority.
        assert_eq!(l.next(&[5, 1, 5, 2, 5]), None);
        assert_eq!(l.next(&[5, 1, 5, 1, 5]), Some(1));
    }
}
