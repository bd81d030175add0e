//! Multi-token-prediction (MTP) self-speculation: the target's own NextN block drafts
//! (`qwen35moe`, `qwen35`, `qwen3next` files with `nextn_predict_layers` ≥ 1; llama.cpp's
//! `common_speculative_impl_draft_mtp`, `common/speculative.cpp`, and `graph_mtp`,
//! `src/models/qwen35moe.cpp`).
//!
//! The block's cache holds, at position `p`, the pair (token `x_p`, the target's output-normed
//! hidden state `h_{p−1}`; zeros at `p = 0`): the target's forwards hand their hidden rows over
//! ([`Draft::hidden`]), and before each proposal the block catches up on the committed pairs it
//! lacks. Its head at the last committed position predicts the first draft token; each further
//! draft step feeds the drafted token with the block's own hidden state from the step before, at
//! the next position (those cells are cut back at the next proposal). Verification is the
//! target's (`speculative::generate`): greedy output equals plain greedy output bit for bit.
//!
//! The block runs on the CPU backend (whatever the target's backend), its experts held in memory.
//!
//! Cross-token lookahead: on a streamed target, the verification forward's rows are known token
//! by token while the block drafts (the last committed token, then each draft). Their embeddings
//! are where that forward's residual stream starts, so they go to the expert scheduler as the
//! FFN inputs of its first [`MtpDraft::lookahead_layers`] layers
//! ([`crate::expert::ExpertSource::on_draft_hidden`]): those layers' experts load while the block
//! still computes, where plain decoding has no prediction for a forward's first layer at all.

use super::sampling::{Sampler, SamplerConfig};
use super::speculative::{draft_sampler, draw, proposal, reset_history, Draft, Proposal};
use super::stream::OpenError;
use super::EngineError;
use crate::expert::bundle::{is_bundle, Bundle};
use crate::expert::ResidentExperts;
use crate::gguf::GgufFile;
use crate::model::{Config, KvCache, Model, ModelError};
use crate::store::ByteSource;
use std::sync::Arc;

/// Most pairs the block's catch-up feeds per forward.
const CATCH_UP: usize = 256;

/// Default γ with MTP (llama.cpp's `--spec-draft-n-max` default, `common_params_speculative_draft::n_max`).
pub const MTP_DRAFT_MAX: usize = 3;

pub struct MtpDraft {
    kv: KvCache,
    /// Tokens of the pairs in `kv`, position order; the first `valid` hold committed tokens and
    /// the target's hidden states, the rest a proposal's own.
    kv_tokens: Vec<u32>,
    valid: usize,
    /// The target's hidden state per position (`h[p·n_embd..]`) and the token at each position.
    h: Vec<f32>,
    h_tokens: Vec<u32>,
    /// Rows arrived after a gap (the target reused a cache beyond the rows held here): no drafts
    /// until the next prompt.
    gap: bool,
    n_embd: usize,
    sampler: Sampler,
    forwards: u64,
    /// A streamed target's expert scheduler (see the module's notes) and the embeddings of the
    /// coming verification's rows so far.
    lookahead: Option<std::sync::Arc<dyn crate::expert::ExpertSource>>,
    look_rows: Vec<f32>,
    /// How many of the target's first layers get the rows' embeddings as a prediction of their
    /// FFN inputs (0: none).
    pub lookahead_layers: usize,
}

/// Default [`MtpDraft::lookahead_layers`]: off. Measured on `rand-qwen35moe-mtp` under 17-49 of
/// 64 expert slots (BENCHMARKS.md, `tools/bench_mtp_lookahead.py`): the drafted rows predict the
/// first layers' experts with ~73% recall and precision, yet one layer moved the hit rate by at
/// most 1.7 points (decode 0.91-1.04×) and two or more layers lowered it (their prefetches evict
/// experts the verification needs).
pub const MTP_LOOKAHEAD_LAYERS: usize = 0;

impl MtpDraft {
    /// A draft for `target` (whose MTP block is loaded: [`Model::load_mtp`]) with `n_ctx` positions.
    pub fn new(target: &Model, n_ctx: usize) -> Result<Self, EngineError> {
        if target.mtp.is_none() {
            return Err(crate::model::ModelError::Unsupported("no multi-token-prediction block is loaded".into()).into());
        }
        Ok(Self {
            kv: target.new_mtp_kv(n_ctx)?,
            kv_tokens: Vec::new(),
            valid: 0,
            h: Vec::new(),
            h_tokens: Vec::new(),
            gap: false,
            n_embd: target.cfg.n_embd,
            sampler: Sampler::new(SamplerConfig::greedy()),
            forwards: 0,
            lookahead: None,
            look_rows: Vec::new(),
            lookahead_layers: MTP_LOOKAHEAD_LAYERS,
        })
    }

    /// The next verification row is `token`: pass the rows so far on to the target's scheduler.
    fn pass_on(&mut self, target: &Model, token: u32, first: bool) {
        let Some(ex) = self.lookahead.as_ref().filter(|_| self.lookahead_layers > 0) else { return };
        if first {
            self.look_rows.clear();
        }
        match target.token_rows(&[token]) {
            Ok(r) => self.look_rows.extend_from_slice(&r),
            Err(_) => return,
        }
        let n = self.lookahead_layers.min(target.cfg.n_layer);
        let rows: Vec<Vec<f32>> = (0..n).map(|_| self.look_rows.clone()).collect();
        ex.on_draft_hidden(&rows);
    }

    /// Bytes of the block's cache.
    pub fn cache_bytes(&self) -> usize {
        KvCache::bytes(1, self.kv.n_ctx, self.kv.n_head_kv, self.kv.head_dim)
    }

    /// The draft chain: from the last committed position, up to `max` tokens.
    fn chain(&mut self, target: &Model, ctx: &[u32], max: usize) -> Result<Proposal, EngineError> {
        let (e, l) = (self.n_embd, ctx.len());
        // The verification starts from the last committed token.
        self.pass_on(target, ctx[l - 1], true);
        // Catch up on the committed pairs (x_p, h_{p−1}) the cache lacks, up to the last one.
        let common = super::common_prefix(&self.kv_tokens, ctx).min(self.valid).min(l - 1);
        let common = self.kv.truncate(common);
        self.kv_tokens.truncate(common);
        let mut out = (Vec::new(), Vec::new());
        let mut p = common;
        while p < l {
            let end = (p + CATCH_UP).min(l);
            let mut hs = vec![0f32; (end - p) * e];
            for q in p.max(1)..end {
                hs[(q - p) * e..(q - p + 1) * e].copy_from_slice(&self.h[(q - 1) * e..q * e]);
            }
            out = target.forward_mtp(&ctx[p..end], &hs, &mut self.kv)?;
            self.forwards += 1;
            p = end;
        }
        self.kv_tokens = ctx.to_vec();
        self.valid = l;
        reset_history(&mut self.sampler, ctx);
        let mut prop = proposal(&self.sampler, max);
        let (mut logits, mut h) = out;
        for i in 0..max {
            let d = draw(&mut self.sampler, &logits, &mut prop);
            self.pass_on(target, d, false);
            if i + 1 < max {
                (logits, h) = target.forward_mtp(&[d], &h, &mut self.kv)?;
                self.kv_tokens.push(d);
                self.forwards += 1;
            }
        }
        Ok(prop)
    }
}

impl Draft for MtpDraft {
    fn name(&self) -> &'static str {
        "MTP"
    }

    fn start(&mut self, sampler: &SamplerConfig) {
        self.sampler = draft_sampler(sampler);
        self.forwards = 0;
    }

    fn prefill(&mut self, prompt: &[u32]) -> Result<(), EngineError> {
        // Rows of an earlier turn's common prefix stay (the target reuses its cache as far).
        let common = super::common_prefix(&self.h_tokens, prompt);
        self.h.truncate(common * self.n_embd);
        self.h_tokens.truncate(common);
        self.gap = false;
        Ok(())
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn hidden(&mut self, pos0: usize, tokens: &[u32], rows: &[f32]) {
        if self.h_tokens.len() < pos0 || rows.len() != tokens.len() * self.n_embd {
            self.gap = true;
            return;
        }
        self.h.truncate(pos0 * self.n_embd);
        self.h_tokens.truncate(pos0);
        self.h.extend_from_slice(rows);
        self.h_tokens.extend_from_slice(tokens);
    }

    fn propose(&mut self, target: &Model, ctx: &[u32], max: usize) -> Result<Proposal, EngineError> {
        // The block's cache holds ctx and max − 1 drafts after the proposal.
        let max = max.min((self.kv.n_ctx + 1).saturating_sub(ctx.len()));
        // Hidden states of every committed position but the last (fed with the drafts).
        if self.gap || max == 0 || ctx.is_empty() || super::common_prefix(&self.h_tokens, ctx) < ctx.len() - 1 {
            return Ok(Proposal::default());
        }
        self.chain(target, ctx, max)
    }

    fn forwards(&self) -> u64 {
        self.forwards
    }

    fn set_lookahead(&mut self, target: Option<std::sync::Arc<dyn crate::expert::ExpertSource>>, _n_embd: usize, _n_layer: usize) {
        // The block is the target's own: its embeddings are the target's.
        self.lookahead = target;
    }
}

/// Load `target`'s MTP block from its model file, a GGUF (`g`: its header) or a `.les` bundle (the
/// block's dense tensors sit in the bundle's dense GGUF, its experts in the bundle's MoE layer of
/// block `n_layer`, checksums verified). Returns the block's weight bytes.
pub fn load_mtp_file(target: &mut Model, src: Arc<dyn ByteSource>, g: &GgufFile) -> Result<usize, OpenError> {
    if !is_bundle(&*src) {
        return Ok(target.load_mtp(&*src, g).map_err(EngineError::from)?);
    }
    let b = Bundle::open(src)?;
    let experts = match bundle_mtp_layer(&b, &target.cfg)? {
        Some(layer) => Some(ResidentExperts::from_store(&b.expert_store(), layer, target.cfg.n_expert).map_err(|e| EngineError::Model(e.into()))?),
        None => None,
    };
    Ok(target.load_mtp_with(&b.dense_source(), b.dense_gguf(), experts).map_err(EngineError::from)?)
}

/// The bytes of the MTP block's weights in a model file (GGUF or bundle): what a memory budget
/// sets aside for them, with the model's config.
pub fn mtp_file_bytes(src: Arc<dyn ByteSource>) -> Result<(u64, Config), OpenError> {
    let config = |g: &GgufFile| Config::from_gguf(g).map_err(|e| EngineError::Model(e.into()));
    if !is_bundle(&*src) {
        let g = GgufFile::read(&*src).map_err(EngineError::from)?;
        let c = config(&g)?;
        return Ok((c.mtp_bytes(&g), c));
    }
    let b = Bundle::open(src)?;
    let c = config(b.dense_gguf())?;
    let experts = match bundle_mtp_layer(&b, &c)? {
        Some(layer) => b.layouts()[layer].bytes() as u64 * c.n_expert as u64,
        None => 0,
    };
    Ok((c.mtp_bytes(b.dense_gguf()) + experts, c))
}

/// The bundle's MoE layer holding the MTP block's experts (None: the model has no MoE MTP block).
fn bundle_mtp_layer(b: &Bundle, c: &Config) -> Result<Option<usize>, OpenError> {
    if c.n_nextn == 0 || !c.is_moe() {
        return Ok(None);
    }
    match b.layer_blocks().iter().position(|&blk| blk as usize == c.n_layer) {
        Some(l) => Ok(Some(l)),
        None => Err(EngineError::Model(ModelError::Unsupported(format!(
            "the bundle holds no experts of the multi-token-prediction block (blk.{}): pack it again from the GGUF with this version of les",
            c.n_layer
        )))
        .into()),
    }
}
