//! Expert stores: where an expert's bytes come from. The unmodified GGUF (three range reads per
//! expert: gate, up, down) or a packed bundle (one contiguous, checksummed read per expert; see
//! [`super::bundle`]).

use super::{ExpertError, ExpertLayout, GgufExpertTensors};
use crate::store::ByteSource;
use std::sync::Arc;

pub trait ExpertStore: Send + Sync {
    fn n_layers(&self) -> usize;
    fn layout(&self, layer: usize) -> &ExpertLayout;
    /// Read expert `expert` of MoE layer `layer` into `buf` (resized to the expert's bytes:
    /// gate, then up, then down). On error `buf`'s contents are unspecified and must not be used.
    fn read_expert(&self, layer: usize, expert: usize, buf: &mut Vec<u8>) -> Result<(), ExpertError> {
        let ranges = self.ranges(layer, expert)?;
        buf.resize(ranges.iter().map(|r| r.1).sum(), 0);
        let mut at = 0;
        for (off, len) in ranges {
            self.read_range(layer, expert, off, &mut buf[at..at + len])?;
            at += len;
        }
        self.verify(layer, expert, buf)
    }
    /// The byte ranges (file offset, length) of one expert, in buffer order. Reading them in
    /// pieces with [`Self::read_range`] and then [`Self::verify`] equals [`Self::read_expert`]:
    /// the streaming cache reads prefetches in chunks so a demand read can overtake them.
    fn ranges(&self, layer: usize, expert: usize) -> Result<Vec<(u64, usize)>, ExpertError>;
    /// Read `buf.len()` bytes at file offset `off` (a piece of one of `expert`'s ranges).
    fn read_range(&self, layer: usize, expert: usize, off: u64, buf: &mut [u8]) -> Result<(), ExpertError>;
    /// Check a completely read expert (a bundle's CRC-32); the GGUF has no checksums.
    fn verify(&self, _layer: usize, _expert: usize, _buf: &[u8]) -> Result<(), ExpertError> {
        Ok(())
    }
    /// Number of range reads one expert costs (3 for GGUF, 1 for a bundle).
    fn reads_per_expert(&self) -> usize;
    fn name(&self) -> &'static str;
    /// Lookahead without a slot: tell the byte source which ranges expert `expert` of `layer`
    /// will need ([`ByteSource::hint`]). Used where no I/O thread can load a prefetch (wasm32).
    fn hint(&self, _layer: usize, _expert: usize) {}
    /// The underlying source serves reads in submission order ([`ByteSource::serves_in_order`]).
    fn serves_in_order(&self) -> bool {
        false
    }
}

/// Experts read straight from the stacked tensors of an unmodified GGUF.
pub struct GgufExpertStore {
    src: Arc<dyn ByteSource>,
    tensors: Vec<GgufExpertTensors>,
    n_expert: usize,
}

impl GgufExpertStore {
    pub fn new(src: Arc<dyn ByteSource>, tensors: Vec<GgufExpertTensors>, n_expert: usize) -> Self {
        Self { src, tensors, n_expert }
    }
}

impl ExpertStore for GgufExpertStore {
    fn n_layers(&self) -> usize {
        self.tensors.len()
    }
    fn layout(&self, layer: usize) -> &ExpertLayout {
        &self.tensors[layer].layout
    }
    fn ranges(&self, layer: usize, expert: usize) -> Result<Vec<(u64, usize)>, ExpertError> {
        match self.tensors.get(layer) {
            Some(t) if expert < self.n_expert => Ok(t.ranges(expert).to_vec()),
            _ => Err(ExpertError::Invalid { layer, expert, why: format!("only {} layers x {} experts", self.tensors.len(), self.n_expert) }),
        }
    }
    fn read_range(&self, layer: usize, expert: usize, off: u64, buf: &mut [u8]) -> Result<(), ExpertError> {
        self.src.read_at(off, buf).map_err(|source| ExpertError::Store { layer, expert, source })
    }
    fn reads_per_expert(&self) -> usize {
        3
    }
    fn hint(&self, layer: usize, expert: usize) {
        if let (Some(t), true) = (self.tensors.get(layer), expert < self.n_expert) {
            for (off, len) in t.ranges(expert) {
                self.src.hint(off, len);
            }
        }
    }
    fn name(&self) -> &'static str {
        "gguf"
    }
    fn serves_in_order(&self) -> bool {
        self.src.serves_in_order()
    }
}
