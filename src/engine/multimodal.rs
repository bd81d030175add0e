//! Prompts with images (llama.cpp `tools/mtmd`): the text split at each media marker, each
//! image encoded by the vision tower into embedding chunks between its marker tokens
//! ([`crate::vision::layout`]), then every chunk run through the text model in order, an image
//! chunk as one batch of embeddings.
//!
//! The session's token record holds a placeholder per image row (an id above the vocabulary
//! derived from the image's content and the row), so prefix reuse works across turns as
//! llama-server's does: the same image at the same place is not encoded or run again; another
//! image there ends the shared prefix.

use super::{EngineError, Session};
use crate::model::Logits;
use crate::vision::layout::{self, Chunk, Markers, MARKER};
use crate::vision::Mmproj;

/// A prompt ready to run: its chunks and the token record (text ids and image placeholders).
pub struct MmPrompt {
    pub chunks: Vec<Chunk>,
    pub tokens: Vec<u32>,
    /// The number of image rows (embeddings) in the prompt.
    pub image_rows: usize,
}

/// What [`Session::prefill_mm`] did.
pub struct MmPrefill {
    /// The token record to pass to [`Session::generate_with`].
    pub tokens: Vec<u32>,
    /// Positions kept from the cache (not run again; their images not encoded again).
    pub reused: usize,
    /// Image pieces encoded and the time it took (ms); the whole prefill's time (ms).
    pub encoded: usize,
    pub encode_ms: f64,
    pub ms: f64,
}

/// FNV-1a over the image file's bytes: the image's identity in the token record.
fn content_hash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The placeholder of row `i` of an image: above every vocabulary id (bit 31 set).
fn placeholder(hash: u64, i: usize) -> u32 {
    let h = (hash ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    0x8000_0000 | ((h >> 33) as u32)
}

/// Whether `id` is an image row's placeholder.
pub fn is_placeholder(id: u32) -> bool {
    id & 0x8000_0000 != 0
}

impl Session {
    /// The marker tokens mtmd puts around an image, found in the vocabulary at the first call
    /// (a scan of every token's piece) and kept.
    pub fn markers(&self) -> Result<Markers, crate::vision::VisionError> {
        if let Some(m) = self.markers.get() {
            return Ok(*m);
        }
        let m = Markers::find(|s| self.lookup_token(s))?;
        Ok(*self.markers.get_or_init(|| m))
    }

    /// The token whose piece is exactly `text` (mtmd's `lookup_token`).
    pub fn lookup_token(&self, text: &str) -> Option<u32> {
        (0..self.tokenizer.n_vocab() as u32).find(|&i| self.tokenizer.token_to_piece(i, true) == text.as_bytes())
    }

    /// Tokenize `text` (with [`MARKER`] where each image goes, in order; markers missing for
    /// some images are put at the start, as `llama-mtmd-cli` does) and prepare `images` (PNG /
    /// JPEG file bytes: decoded, resized, sliced) for `mmproj`; [`Self::prefill_mm`] encodes
    /// the pieces the cache does not hold.
    pub fn mm_prompt(&self, mmproj: &Mmproj, text: &str, images: &[Vec<u8>]) -> Result<MmPrompt, EngineError> {
        if mmproj.n_embd_out != self.model.cfg.n_embd {
            return Err(crate::vision::VisionError::Width { mmproj: mmproj.n_embd_out, text: self.model.cfg.n_embd }.into());
        }
        let n_markers = text.matches(MARKER).count();
        let text = if n_markers < images.len() { format!("{}{text}", MARKER.repeat(images.len() - n_markers)) } else { text.to_string() };
        let segs: Vec<&str> = text.split(MARKER).collect();
        if segs.len() - 1 != images.len() {
            return Err(EngineError::Vision(crate::vision::VisionError::Invalid {
                key: "prompt".into(),
                value: format!("{} media markers", segs.len() - 1),
                why: "must match the number of images",
            }));
        }
        let markers = self.markers()?;
        let mut chunks: Vec<Chunk> = Vec::new();
        let mut image_rows = 0;
        for (i, seg) in segs.iter().enumerate() {
            // mtmd: the first text part gets BOS (when the vocabulary adds it), special tokens parsed.
            let toks = self.tokenizer.encode(seg, i == 0, true);
            if !toks.is_empty() {
                match chunks.last_mut() {
                    Some(Chunk::Text(v)) => v.extend(toks),
                    _ => chunks.push(Chunk::Text(toks)),
                }
            }
            if let Some(img) = images.get(i) {
                let prep = mmproj.prepare(img)?;
                let mut pieces = Vec::with_capacity(1 + prep.slices.len());
                for p in std::iter::once(prep.overview).chain(prep.slices) {
                    let rows = mmproj.n_tokens(p.w, p.h);
                    image_rows += rows;
                    pieces.push((rows, p));
                }
                layout::push_image(&mut chunks, &markers, pieces, prep.grid, &format!("{:016x}", content_hash(img)));
            }
        }
        let mut tokens = Vec::new();
        for c in &chunks {
            match c {
                Chunk::Text(t) => tokens.extend_from_slice(t),
                Chunk::Image { rows, id, .. } => {
                    let h = content_hash(id.as_bytes());
                    tokens.extend((0..*rows).map(|r| placeholder(h, r)));
                }
            }
        }
        Ok(MmPrompt { chunks, tokens, image_rows })
    }

    /// Run every chunk of `p` but its last token into the cache (reusing the cached prefix the
    /// prompt shares; the image pieces it covers are not encoded), checkpoint the recurrent
    /// state there, and return the token record: pass it to [`Session::generate_with`] (with
    /// [`Session::reuse_prefix`] on), which runs the last token and generates.
    pub fn prefill_mm(&mut self, mmproj: &Mmproj, p: &MmPrompt) -> Result<MmPrefill, EngineError> {
        #[cfg(not(target_arch = "wasm32"))]
        return crate::backend::wgpu::block_on(self.prefill_mm_async(mmproj, p));
        #[cfg(target_arch = "wasm32")]
        return crate::backend::ops::ready(self.prefill_mm_async(mmproj, p)).map_err(crate::model::ModelError::from)?;
    }

    /// [`Self::prefill_mm`] as a future: on the GPU it awaits the readbacks (the browser cannot
    /// block); on the CPU it is ready at once.
    pub async fn prefill_mm_async(&mut self, mmproj: &Mmproj, p: &MmPrompt) -> Result<MmPrefill, EngineError> {
        let t0 = super::now_ms();
        let all = &p.tokens;
        if all.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if all.len() > self.kv.n_ctx {
            return Err(EngineError::PromptTooLong(all.len(), self.kv.n_ctx));
        }
        if !matches!(p.chunks.last(), Some(Chunk::Text(_))) {
            return Err(EngineError::Vision(crate::vision::VisionError::Invalid { key: "prompt".into(), value: "an image".into(), why: "must end with text" }));
        }
        let was = self.reuse_prefix;
        self.reuse_prefix = true;
        let mut kept = self.reuse(all);
        self.reuse_prefix = was;
        // A kept prefix that ends inside an image chunk goes back to the chunk's start.
        let mut s = 0;
        for c in &p.chunks {
            let e = s + c.n_tokens();
            if matches!(c, Chunk::Image { .. }) && s < kept && kept < e {
                kept = self.kv.truncate(s);
                self.cached.truncate(kept);
                break;
            }
            s = e;
        }
        let reused = kept;
        let (mut encoded, mut encode_ms) = (0, 0.0);
        let end = all.len() - 1;
        let batch = if self.prefill_batch == 0 { crate::backend::cpu::kv::UBATCH } else { self.prefill_batch };
        let mut s = 0;
        for c in &p.chunks {
            let e = s + c.n_tokens();
            let (from, to) = (s.max(kept), e.min(end));
            if from < to {
                match c {
                    Chunk::Text(t) => {
                        for part in t[from - s..to - s].chunks(batch) {
                            self.forward_async(part, Logits::Last).await?;
                        }
                    }
                    Chunk::Image { rows, piece, .. } => {
                        let t = super::now_ms();
                        let embd = self.encode_piece(mmproj, piece).await?;
                        (encoded, encode_ms) = (encoded + 1, encode_ms + super::now_ms() - t);
                        self.forward_embd(&embd, *rows, &all[s..e]).await?
                    }
                }
            }
            s = e;
        }
        self.kv.checkpoint();
        Ok(MmPrefill { tokens: all.clone(), reused, encoded, encode_ms, ms: super::now_ms() - t0 })
    }

    /// One image piece's embeddings, on the session's backend.
    async fn encode_piece(&self, mmproj: &Mmproj, p: &crate::vision::image::RgbF32) -> Result<Vec<f32>, EngineError> {
        match &self.gpu {
            Some(g) => Ok(mmproj.encode_gpu(&g.ctx, &self.gpu_opts, p).await?),
            None => Ok(mmproj.encode(p)?),
        }
    }

    /// One image chunk (`rows` embeddings) at the cache's end, recorded as `ids`.
    async fn forward_embd(&mut self, embd: &[f32], rows: usize, ids: &[u32]) -> Result<(), EngineError> {
        self.apply_budget()?;
        self.cached.truncate(self.kv.len);
        let pos0 = self.kv.len;
        let r = match &self.gpu {
            Some(g) => self.model.forward_gpu_embd(g, embd, rows, &mut self.kv, Logits::Last).await,
            None => self.model.forward_embd(embd, rows, &mut self.kv, Logits::Last),
        };
        self.commit(pos0, ids, r).map(|_| ())
    }
}
