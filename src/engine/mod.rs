//! Sessions: a model, its tokenizer and a KV cache; prompt processing, the generation loop,
//! sampling and chat templates.

pub mod chat;
pub mod draft;
pub mod eval;
pub mod generation;
pub mod gpu_cost;
pub mod sampling;
pub mod speculative;
#[cfg(not(target_arch = "wasm32"))]
pub mod ladder;
#[cfg(not(target_arch = "wasm32"))]
pub mod mixed;
pub mod mtp;
pub mod multimodal;
pub mod plan;
#[cfg(not(target_arch = "wasm32"))]
pub mod pressure;
pub mod reserve;
pub mod stream;

use crate::gguf::{GgufError, GgufFile};
use crate::model::{ExpertMode, KvCache, Logits, Model, ModelError};
use crate::store::ByteSource;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::backend::wgpu::exec::GpuBackend;
#[cfg(not(target_arch = "wasm32"))]
use crate::backend::{wgpu::exec::GpuOptions, BackendKind};
pub use generation::{ContextMode, FinishReason, GenOptions, Generation, StopStrings};
use sampling::SamplerConfig;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Chat(#[from] chat::ChatError),
    #[error("the prompt is empty after tokenization")]
    EmptyPrompt,
    #[error("prompt of {0} tokens does not fit the context of {1} (raise --ctx-size)")]
    PromptTooLong(usize, usize),
    #[error(transparent)]
    Gpu(#[from] crate::backend::wgpu::GpuError),
    #[error(transparent)]
    Vision(#[from] crate::vision::VisionError),
}

/// Timing and counts of one generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values were reused from the previous generation (the longest
    /// common prefix; not run again).
    pub prompt_reused: usize,
    pub prompt_ms: f64,
    pub gen_tokens: usize,
    pub gen_ms: f64,
    /// Why generation ended (`None` while it runs).
    pub finish_reason: Option<FinishReason>,
    /// Context shifts made (each dropped the older half of the tokens after `n_keep`).
    pub context_shifts: usize,
}

impl GenStats {
    /// Prompt tokens run per second (reused tokens are not run).
    pub fn prompt_tps(&self) -> f64 {
        (self.prompt_tokens - self.prompt_reused.min(self.prompt_tokens)) as f64 / (self.prompt_ms / 1000.0).max(1e-9)
    }
    pub fn gen_tps(&self) -> f64 {
        self.gen_tokens as f64 / (self.gen_ms / 1000.0).max(1e-9)
    }
}

/// Turns token bytes into text chunks, holding back incomplete UTF-8 sequences.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) => match e.error_len() {
                // Invalid bytes (not merely incomplete): emit them lossily.
                Some(_) => self.pending.len(),
                None => e.valid_up_to(),
            },
        };
        let out = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        self.pending.drain(..valid);
        out
    }
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

pub struct Session {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub kv: KvCache,
    pub gguf: GgufFile,
    /// Prompt tokens per forward pass (0: [`crate::backend::cpu::kv::UBATCH`], llama.cpp's
    /// default `n_ubatch`; it bounds the activations and a sliding-window layer's cells).
    pub prefill_batch: usize,
    /// The GPU forward when the session runs on the wgpu backend (`None`: the CPU).
    pub gpu: Option<GpuBackend>,
    /// Keep the cache between generations and reuse its longest common token prefix with the
    /// next prompt (llama.cpp server's `cache_prompt`). Off by default: benchmarks and tests run
    /// the same prompt again and want it computed; chats, `les serve` and the JS chat API turn it on.
    pub reuse_prefix: bool,
    /// A chat template used instead of the GGUF's `tokenizer.chat_template` (llama.cpp's
    /// `--chat-template-file`).
    pub chat_template: Option<String>,
    /// The tokens at positions `0..kv.len` of the cache (valid up to `kv.len`).
    cached: Vec<u32>,
    /// The options the GPU backend was made with (a vision tower uses the same).
    pub gpu_opts: crate::backend::wgpu::exec::GpuOptions,
    /// The image marker tokens, looked up in the vocabulary once ([`Session::markers`]).
    markers: std::sync::OnceLock<crate::vision::layout::Markers>,
    /// A streaming session's budget: its dense re-plans ([`stream::BudgetControl::set`]) are
    /// applied by [`Session::apply_budget`], which also lowers it when the allocator gave back
    /// its reserve ([`reserve`]).
    pub(crate) budget_ctl: Option<stream::BudgetControl>,
}

/// Current and peak resident memory of this process in bytes (Linux; `None` elsewhere).
pub fn memory_usage() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let l = s.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

impl Session {
    pub fn load(src: &dyn ByteSource, mode: ExpertMode, n_ctx: usize) -> Result<Self, EngineError> {
        Self::load_with_batch(src, mode, n_ctx, 0)
    }

    pub fn load_with_batch(src: &dyn ByteSource, mode: ExpertMode, n_ctx: usize, prefill_batch: usize) -> Result<Self, EngineError> {
        Self::load_streaming_dense(src, mode, n_ctx, prefill_batch, None)
    }

    /// [`Session::load_with_batch`], the matrices `dense` names read from storage at each use.
    pub fn load_streaming_dense(src: &dyn ByteSource, mode: ExpertMode, n_ctx: usize, prefill_batch: usize, dense: Option<&crate::model::DenseStreaming>) -> Result<Self, EngineError> {
        let gguf = GgufFile::read(src)?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let model = Model::load_with(src, &gguf, mode, dense)?;
        let n_ctx = n_ctx.min(model.cfg.n_ctx_train.max(1));
        let kv = model.new_kv(n_ctx)?;
        Ok(Self { model, tokenizer, kv, gguf, prefill_batch, gpu: None, reuse_prefix: false, chat_template: None, cached: Vec::new(), gpu_opts: Default::default(), markers: Default::default(), budget_ctl: None })
    }

    /// Run on `kind`: `Cpu` keeps the CPU; `Wgpu` uploads the dense weights to the GPU (an error
    /// when no adapter exists); `Auto` uses a hardware GPU when there is one and the CPU otherwise
    /// (software adapters such as lavapipe are slower than the CPU backend). Returns a line
    /// describing the choice.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn set_backend(&mut self, kind: BackendKind, opts: &GpuOptions) -> Result<String, EngineError> {
        use crate::backend::wgpu::GpuContext;
        let ctx = match kind {
            BackendKind::Cpu => {
                self.use_cpu()?;
                return Ok("backend: cpu".into());
            }
            BackendKind::Wgpu => GpuContext::new()?,
            BackendKind::Auto if self.model.weights.has_streamed() => {
                self.use_cpu()?;
                return Ok("backend: cpu (auto: dense weights are read from storage, which only the CPU backend does)".into());
            }
            BackendKind::Auto => match GpuContext::probe() {
                Ok(info) if GpuContext::auto_takes(&info) => GpuContext::new()?,
                Ok(info) => {
                    self.use_cpu()?;
                    return Ok(format!("backend: cpu (auto: the only GPU adapter, {}, is a software rasterizer)", info.name));
                }
                Err(e) => {
                    self.use_cpu()?;
                    return Ok(format!("backend: cpu (auto: {e})"));
                }
            },
        };
        let name = format!("{} ({:?})", ctx.info.name, ctx.info.backend);
        self.use_gpu(ctx, opts)?;
        let g = self.gpu.as_ref().expect("use_gpu set it");
        Ok(format!("backend: wgpu on {name}; kernels: {}", g.kernel_variant()))
    }

    /// Run on the GPU of `ctx`: upload the dense weights (experts go to GPU slots as routed).
    pub fn use_gpu(&mut self, ctx: crate::backend::wgpu::GpuContext, opts: &crate::backend::wgpu::exec::GpuOptions) -> Result<(), EngineError> {
        // The GPU reads the file's layout (the host keeps running lookups on the same bytes).
        self.model.weights.unpack();
        let m = &self.model;
        let sh = m.gpu_shapes(self.kv.n_ctx);
        let gpu = GpuBackend::new(std::sync::Arc::new(ctx), &m.weights, sh, m.experts(), opts)?;
        self.gpu_opts = opts.clone();
        // Keys and values live on the GPU; the CPU cache keeps only the position count and
        // whether the sliding-window rings still hold what a rollback needs. (Recurrent states
        // too; the cache keeps the checkpoint bookkeeping the GPU mirrors.)
        let c = &self.model.cfg;
        // Every sliding-window layer has the window `n_swa` and a ring of `swa_cells`.
        let rings: &[(usize, usize)] = if sh.swa_layers > 0 { &[(c.n_swa, sh.swa_cells)] } else { &[] };
        self.kv = KvCache::positions_only(self.kv.n_ctx, c.has_recurrent(), rings, c.n_head_kv, c.head_dim);
        self.gpu = Some(gpu);
        self.set_on_gpu(true);
        Ok(())
    }

    /// Tell the budget whether the session runs on a GPU (which holds its own copy of the dense
    /// weights: no dense re-plans then).
    fn set_on_gpu(&self, on: bool) {
        if let Some(r) = self.budget_ctl.as_ref().and_then(|b| b.dense_replan()) {
            r.on_gpu.store(on, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Apply what the memory budget changed since the last forward: after the allocator gave
    /// back its reserve (an allocation the heap refused, [`reserve`]), lower the budget by an
    /// eighth (not below the minimum) and take a new reserve; then free the dense matrices the
    /// budget asked to read from storage, or read back those it can hold again (on an error, a
    /// failed read, the weights stay as they were). Every forward calls it first; a caller that
    /// owns the session can call it at once to free the memory now.
    pub fn apply_budget(&mut self) -> Result<(), EngineError> {
        if reserve::take_releases() > 0 {
            if let Some(b) = &self.budget_ctl {
                let now = b.budget();
                let _ = b.set(now.saturating_sub(now / 8).max(b.minimum()));
                reserve::set_reserve(reserve::reserve_for(b.budget()));
            }
        }
        let Some(d) = self.budget_ctl.as_ref().and_then(|b| b.dense_replan()).and_then(|r| r.take()) else { return Ok(()) };
        if self.gpu.is_some() {
            return Ok(());
        }
        self.model.replan_dense(&d)?;
        stream::after_dense_replan();
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn use_cpu(&mut self) -> Result<(), EngineError> {
        if self.gpu.take().is_some() {
            self.kv = self.model.new_kv(self.kv.n_ctx)?;
        }
        self.set_on_gpu(false);
        Ok(())
    }

    /// One forward pass on the session's backend.
    pub fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, EngineError> {
        self.apply_budget()?;
        self.cached.truncate(self.kv.len);
        let pos0 = self.kv.len;
        #[cfg(not(target_arch = "wasm32"))]
        let r = match &self.gpu {
            Some(g) => self.model.forward_gpu_blocking(g, tokens, &mut self.kv, want),
            None => self.model.forward(tokens, &mut self.kv, want),
        };
        #[cfg(target_arch = "wasm32")]
        let r = self.model.forward(tokens, &mut self.kv, want);
        self.commit(pos0, tokens, r)
    }

    /// After a forward of `tokens` at `pos0`: on success the cache holds them; on an error (a GPU
    /// forward may have advanced by whole chunks) it holds what it held before.
    pub(crate) fn commit(&mut self, pos0: usize, tokens: &[u32], r: Result<Vec<f32>, crate::model::ModelError>) -> Result<Vec<f32>, EngineError> {
        match r {
            Ok(l) => {
                self.cached.extend_from_slice(tokens);
                Ok(l)
            }
            Err(e) => {
                self.kv.restore(pos0);
                self.cached.truncate(self.kv.len);
                Err(e.into())
            }
        }
    }

    /// [`Session::forward`] as a future: on the GPU it awaits the readbacks (the browser cannot
    /// block); on the CPU it is ready at once.
    pub async fn forward_async(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, EngineError> {
        match &self.gpu {
            Some(g) => {
                self.cached.truncate(self.kv.len);
                let pos0 = self.kv.len;
                let r = self.model.forward_gpu(g, tokens, &mut self.kv, want).await;
                self.commit(pos0, tokens, r)
            }
            None => self.forward(tokens, want),
        }
    }

    /// [`Session::forward`] with every row computed as a single-token forward would compute it
    /// (see [`crate::model::Model::forward_per_row`]); the GPU backend's batches already are.
    pub fn forward_per_row(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, EngineError> {
        #[cfg(not(target_arch = "wasm32"))]
        if self.gpu.is_some() {
            return self.forward(tokens, want);
        }
        self.apply_budget()?;
        self.cached.truncate(self.kv.len);
        let pos0 = self.kv.len;
        let r = self.model.forward_per_row(tokens, &mut self.kv, want);
        self.commit(pos0, tokens, r)
    }

    /// The tokens whose keys and values the cache holds, in position order.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached[..self.kv.len.min(self.cached.len())]
    }

    /// Forget the cached conversation (the next prompt runs from position 0).
    pub fn reset(&mut self) {
        self.kv.clear();
        self.cached.clear();
    }

    /// Make the cache ready for `prompt`: keep the longest common prefix of the cached tokens and
    /// `prompt` when [`Self::reuse_prefix`] is on (at most `prompt.len() - 1`: the last token is
    /// run for its logits), clear it otherwise. Returns the number of positions kept.
    ///
    /// A model with recurrent layers (qwen35moe, qwen3next) can go back only to where its state
    /// was saved ([`KvCache::checkpoint`]: the end of the previous prompt) or to the start; the
    /// positions kept are then fewer than the common prefix.
    pub fn reuse(&mut self, prompt: &[u32]) -> usize {
        let n = if self.reuse_prefix { common_prefix(self.cached_tokens(), prompt).min(prompt.len().saturating_sub(1)) } else { 0 };
        if n == 0 {
            self.kv.clear();
        }
        let n = self.kv.truncate(n);
        self.cached.truncate(n);
        n
    }

    /// Run the prompt (in batches of `prefill_batch`), returning the last position's logits.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
        let b = if self.prefill_batch == 0 { crate::backend::cpu::kv::UBATCH } else { self.prefill_batch };
        // A recurrent state cannot be cut back: keep a copy before the prompt's last token, where
        // the same prompt again (regenerate) or a longer one (the next turn) comes back to.
        let (head, last) = match self.kv.rs.iter().any(Option::is_some) {
            true if prompt.len() > 1 => prompt.split_at(prompt.len() - 1),
            _ => (prompt, &[][..]),
        };
        let mut logits = Vec::new();
        for chunk in head.chunks(b) {
            logits = self.forward(chunk, Logits::Last)?;
        }
        if !last.is_empty() {
            self.kv.checkpoint();
            logits = self.forward(last, Logits::Last)?;
        }
        Ok(logits)
    }

    /// Prompt text for a single user message through the model's chat template.
    pub fn chat_prompt(&self, messages: &[chat::Message]) -> Result<String, EngineError> {
        let t = self.chat_template.as_deref().or_else(|| self.gguf.get_str("tokenizer.chat_template")).ok_or(chat::ChatError::NoTemplate)?;
        let piece = |id: Option<u32>| id.map(|i| self.tokenizer.token_text(i).to_string()).unwrap_or_default();
        let bos = piece(self.tokenizer.bos());
        // A harmony reply sent back as it was generated (headers, reasoning) keeps its final
        // answer only, as llama.cpp's parser hands it back (gpt-oss's template refuses the tags).
        let clean: Vec<chat::Message> = messages
            .iter()
            .map(|m| match (m.role.as_str(), chat::split_harmony(&m.content)) {
                ("assistant", Some((_, content))) => chat::Message { role: m.role.clone(), content },
                _ => m.clone(),
            })
            .collect();
        let text = chat::render(t, &clean, &bos, &piece(self.tokenizer.eos()))?;
        // Tokenizing adds BOS itself: a template's own leading BOS text would make it twice
        // (llama.cpp's common/chat.cpp strips it the same way).
        Ok(match text.strip_prefix(bos.as_str()) {
            Some(rest) if self.tokenizer.add_bos() && !bos.is_empty() => rest.to_string(),
            _ => text,
        })
    }

    /// Tokenize as llama-completion does (add special tokens, parse special tokens in text).
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        self.tokenizer.encode(text, true, true)
    }

    /// Run the prompt and then sample up to `n` tokens, calling `on_text` with each decoded chunk
    /// (return false to stop). Stops at an end-of-generation token unless `ignore_eos`.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        n: usize,
        sampler: &SamplerConfig,
        ignore_eos: bool,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<(Vec<u32>, GenStats), EngineError> {
        let o = GenOptions { n, sampler: sampler.clone(), ignore_eos, ..Default::default() };
        self.generate_with(prompt, &o, on_token)
    }

    /// [`Self::generate`] with every option: stop strings, what to do when the context is full.
    pub fn generate_with(&mut self, prompt: &[u32], o: &GenOptions, on_token: &mut dyn FnMut(u32, &str) -> bool) -> Result<(Vec<u32>, GenStats), EngineError> {
        let mut g = Generation::with_options(self, prompt, o)?;
        while let Some(input) = g.next_input() {
            let logits = if input.len() > 1 { self.prefill(&input)? } else { self.forward(&input, Logits::Last)? };
            if let Some((tok, text)) = g.feed(self, &logits) {
                if !on_token(tok, &text) {
                    g.stop();
                }
            }
        }
        let rest = g.finish();
        if !rest.is_empty() {
            on_token(u32::MAX, &rest);
        }
        Ok((g.out, g.stats))
    }
}

pub use crate::clock::now_ms;

/// Length of the longest common prefix of two token sequences (what a cache holding `a` can keep
/// for `b`).
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::Utf8Stream;

    #[test]
    fn utf8_stream_holds_back_partial_sequences() {
        let mut u = Utf8Stream::default();
        let e = "é".as_bytes();
        assert_eq!(u.push(&e[..1]), "");
        assert_eq!(u.push(&e[1..]), "é");
        assert_eq!(u.push(b"ab"), "ab");
        assert_eq!(u.push(&[0xF0, 0x9F]), "");
        assert_eq!(u.finish(), "\u{FFFD}");
    }
}
