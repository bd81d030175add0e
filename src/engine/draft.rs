//! The draft of speculative decoding as `les run`, `les serve` and the C ABI name it: a draft
//! model (llama.cpp's `--model-draft`), prompt lookup (n-grams of the prompt and the output), or
//! the model's own multi-token-prediction block (llama.cpp's `--spec-type draft-mtp`). A draft's
//! memory comes out of the target's budget: [`DraftSpec::reserve`] gives the bytes to set aside
//! before the target opens, [`DraftSpec::open`] loads the draft beside the opened target.

use super::mtp::{load_mtp_file, mtp_file_bytes, MtpDraft, MTP_DRAFT_MAX};
use super::speculative::{Draft, DraftModel, PromptLookup, SpecError, DRAFT_MODEL_DRAFT_MAX, LOOKUP_DRAFT_MAX};
use super::stream::OpenError;
use super::{EngineError, Session};
use crate::gguf::GgufFile;
use crate::model::{Config, KvCache};
use crate::store::ByteSource;
use std::sync::Arc;

/// Which draft proposes the tokens the target verifies.
#[derive(Clone)]
pub enum DraftSpec {
    /// A smaller model with the target's vocabulary (GGUF), all of it resident.
    Model(Arc<dyn ByteSource>),
    /// Prompt lookup: the continuation of the longest recent n-gram seen before.
    Lookup,
    /// The target's MTP block (`nextn_predict_layers`); `lookahead`: how many of the target's
    /// first layers get experts prefetched from the drafted rows' embeddings.
    Mtp { lookahead: usize },
}

impl std::fmt::Debug for DraftSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftSpec::Mtp { lookahead } => write!(f, "MTP (lookahead {lookahead})"),
            d => f.write_str(d.name()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Open(#[from] OpenError),
}

/// A loaded draft and what it holds in memory.
pub struct OpenedDraft {
    pub draft: Box<dyn Draft + Send>,
    /// Bytes of weights (a draft model's, the MTP block's; 0 for prompt lookup).
    pub weight_bytes: u64,
    /// Bytes of the draft's own KV cache.
    pub cache_bytes: u64,
}

impl DraftSpec {
    /// A draft model read from the GGUF file at `path`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn model_file(path: &str) -> Result<Self, crate::store::StoreError> {
        Ok(DraftSpec::Model(Arc::new(crate::store::FileSource::open(path)?)))
    }

    pub fn name(&self) -> &'static str {
        match self {
            DraftSpec::Model(_) => "draft model",
            DraftSpec::Lookup => "prompt lookup",
            DraftSpec::Mtp { .. } => "MTP",
        }
    }

    /// Draft tokens verified per target forward when the caller gives none (measured per kind:
    /// BENCHMARKS.md "Speculative decoding" and "MTP self-speculation").
    pub fn default_max(&self) -> usize {
        match self {
            DraftSpec::Model(_) => DRAFT_MODEL_DRAFT_MAX,
            DraftSpec::Lookup => LOOKUP_DRAFT_MAX,
            DraftSpec::Mtp { .. } => MTP_DRAFT_MAX,
        }
    }

    /// Bytes the draft takes beside a target read from `target` with `n_ctx` positions: a draft
    /// model's weights and KV cache; the MTP block's weights and its one layer's cache.
    pub fn reserve(&self, target: Arc<dyn ByteSource>, n_ctx: usize) -> Result<u64, DraftError> {
        Ok(match self {
            DraftSpec::Model(src) => {
                let g = GgufFile::read(&**src).map_err(|e| OpenError::from(EngineError::from(e)))?;
                let c = Config::from_gguf(&g).map_err(|e| OpenError::from(EngineError::Model(e.into())))?;
                g.tensors.iter().map(|t| t.size).sum::<u64>() + c.cache_bytes(n_ctx.min(c.n_ctx_train.max(1))) as u64
            }
            DraftSpec::Lookup => 0,
            DraftSpec::Mtp { .. } => {
                let (bytes, c) = mtp_file_bytes(target)?;
                bytes + KvCache::bytes(1, n_ctx.min(c.n_ctx_train.max(1)), c.n_head_kv, c.head_dim) as u64
            }
        })
    }

    /// Load the draft for `sess`, whose model was read from `target` (the MTP block is loaded
    /// into it).
    pub fn open(&self, target: Arc<dyn ByteSource>, sess: &mut Session) -> Result<OpenedDraft, DraftError> {
        Ok(match self {
            DraftSpec::Model(src) => {
                let d = DraftModel::load(&**src, &sess.tokenizer, sess.kv.n_ctx)?;
                let cache_bytes = d.cache_bytes() as u64;
                OpenedDraft { weight_bytes: d.bytes, cache_bytes, draft: Box::new(d) }
            }
            DraftSpec::Lookup => OpenedDraft { draft: Box::new(PromptLookup::default()), weight_bytes: 0, cache_bytes: 0 },
            DraftSpec::Mtp { lookahead } => {
                let bytes = load_mtp_file(&mut sess.model, target, &sess.gguf)?;
                let mut d = MtpDraft::new(&sess.model, sess.kv.n_ctx).map_err(SpecError::from)?;
                d.lookahead_layers = *lookahead;
                OpenedDraft { weight_bytes: bytes as u64, cache_bytes: d.cache_bytes() as u64, draft: Box::new(d) }
            }
        })
    }
}
