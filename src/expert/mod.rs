//! Experts: the one narrow interface through which model code reaches MoE expert weights.
//!
//! Model code asks for the experts its router chose, in top-k rank order, and receives each
//! expert's weights as one contiguous [`ExpertBlock`] (gate, up and down matrices). Whether the
//! block was resident, prefetched or read on demand is invisible to the model: it always combines
//! expert outputs in rank order, so results never depend on what was resident.

use crate::backend::cpu::matmul::WeightRef;
use crate::gguf::{GgufError, GgufFile};
use crate::quant::GgmlType;
use crate::store::{ByteSource, StoreError};
use std::ops::Range;
use std::sync::Arc;

/// Shape and types of one layer's experts (all experts of a layer share them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    pub n_embd: usize,
    pub n_ff: usize,
    pub gate_ty: GgmlType,
    pub up_ty: GgmlType,
    pub down_ty: GgmlType,
    /// Byte lengths of one expert's gate, up and down matrices.
    pub gate_bytes: usize,
    pub up_bytes: usize,
    pub down_bytes: usize,
}

impl ExpertLayout {
    pub fn bytes(&self) -> usize {
        self.gate_bytes + self.up_bytes + self.down_bytes
    }
}

/// Where one layer's stacked expert tensors live in a GGUF file.
#[derive(Clone, Debug)]
pub struct GgufExpertTensors {
    pub layout: ExpertLayout,
    /// Absolute file offsets of the stacked `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` data.
    pub gate_off: u64,
    pub up_off: u64,
    pub down_off: u64,
}

impl GgufExpertTensors {
    /// Byte ranges (offset, length) of expert `e`'s gate, up and down matrices in the file.
    pub fn ranges(&self, e: usize) -> [(u64, usize); 3] {
        let l = &self.layout;
        [
            (self.gate_off + (e * l.gate_bytes) as u64, l.gate_bytes),
            (self.up_off + (e * l.up_bytes) as u64, l.up_bytes),
            (self.down_off + (e * l.down_bytes) as u64, l.down_bytes),
        ]
    }

    /// Find layer `il`'s stacked expert tensors (llama.cpp names `blk.N.ffn_{gate,up,down}_exps.weight`).
    pub fn find(g: &GgufFile, il: usize, n_embd: usize, n_expert: usize) -> Result<Self, GgufError> {
        let t = |n: &str| g.req_tensor(&format!("blk.{il}.{n}.weight"));
        let (gate, up, down) = (t("ffn_gate_exps")?, t("ffn_up_exps")?, t("ffn_down_exps")?);
        let bad = |name: &str, dims: &[u64], why| GgufError::BadShape { name: name.into(), dims: dims.to_vec(), why };
        let n_ff = gate.dims.get(1).copied().unwrap_or(0) as usize;
        for (ti, want) in [(gate, [n_embd, n_ff, n_expert]), (up, [n_embd, n_ff, n_expert]), (down, [n_ff, n_embd, n_expert])] {
            if ti.dims.len() != 3 || ti.dims.iter().zip(want).any(|(&d, w)| d as usize != w) {
                return Err(bad(&ti.name, &ti.dims, "expected [n_embd, n_ff, n_expert] (gate/up) or [n_ff, n_embd, n_expert] (down)"));
            }
        }
        let per = |ti: &crate::gguf::TensorInfo| (ti.size / n_expert as u64) as usize;
        Ok(Self {
            layout: ExpertLayout {
                n_embd,
                n_ff,
                gate_ty: gate.ty,
                up_ty: up.ty,
                down_ty: down.ty,
                gate_bytes: per(gate),
                up_bytes: per(up),
                down_bytes: per(down),
            },
            gate_off: gate.offset,
            up_off: up.offset,
            down_off: down.offset,
        })
    }
}

/// One expert's weights in one contiguous buffer: gate, then up, then down.
#[derive(Debug)]
pub struct ExpertBlock {
    pub data: Vec<u8>,
    pub layout: ExpertLayout,
    /// Which of gate, up and down are in [`crate::quant::repack`]'s layout (each in its own
    /// byte range; the others as the file has them).
    pub repacked: [bool; 3],
}

impl ExpertBlock {
    /// An expert's bytes as the file has them.
    pub fn new(data: Vec<u8>, layout: ExpertLayout) -> Self {
        Self { data, layout, repacked: [false; 3] }
    }
    /// Put each matrix in [`crate::quant::repack`]'s layout where its type has one and it
    /// [pays](crate::quant::repack::pays) (`always`: tests).
    pub fn repack(&mut self, always: bool) {
        if !(always || crate::quant::repack::pays()) {
            return;
        }
        for m in 0..3 {
            let (ty, cols, rows) = self.shape(m);
            let r = self.range(m);
            self.repacked[m] = self.repacked[m] || crate::quant::repack::pack(ty, cols, rows, &mut self.data[r]);
        }
    }
    /// Matrix `which` (0 gate, 1 up, 2 down) as the file has it (an unpacked copy where it is
    /// repacked): for a backend that reads the bytes as they are (a GPU upload).
    pub fn file_bytes(&self, which: usize) -> std::borrow::Cow<'_, [u8]> {
        let r = self.range(which);
        if !self.repacked[which.min(2)] {
            return std::borrow::Cow::Borrowed(&self.data[r]);
        }
        let (ty, cols, rows) = self.shape(which);
        let mut v = self.data[r].to_vec();
        crate::quant::repack::unpack(ty, cols, rows, &mut v);
        std::borrow::Cow::Owned(v)
    }
    fn shape(&self, which: usize) -> (GgmlType, usize, usize) {
        let l = &self.layout;
        match which {
            0 => (l.gate_ty, l.n_embd, l.n_ff),
            1 => (l.up_ty, l.n_embd, l.n_ff),
            _ => (l.down_ty, l.n_ff, l.n_embd),
        }
    }
    fn weight(&self, which: usize) -> WeightRef<'_> {
        let (ty, cols, rows) = self.shape(which);
        WeightRef { ty, cols, rows, data: &self.data[self.range(which)], repacked: self.repacked[which.min(2)] }
    }
    fn range(&self, which: usize) -> Range<usize> {
        let l = &self.layout;
        match which {
            0 => 0..l.gate_bytes,
            1 => l.gate_bytes..l.gate_bytes + l.up_bytes,
            _ => l.gate_bytes + l.up_bytes..l.bytes(),
        }
    }
    pub fn gate(&self) -> WeightRef<'_> {
        self.weight(0)
    }
    pub fn up(&self) -> WeightRef<'_> {
        self.weight(1)
    }
    pub fn down(&self) -> WeightRef<'_> {
        self.weight(2)
    }
    /// Read expert `e` of a layer from a GGUF source (three range reads).
    pub fn read_from_gguf(src: &dyn ByteSource, t: &GgufExpertTensors, e: usize) -> Result<Self, StoreError> {
        let mut data = vec![0u8; t.layout.bytes()];
        let mut at = 0;
        for (off, len) in t.ranges(e) {
            src.read_at(off, &mut data[at..at + len])?;
            at += len;
        }
        Ok(Self::new(data, t.layout.clone()))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    #[error("reading expert {expert} of layer {layer}: {source}")]
    Store { layer: usize, expert: usize, source: StoreError },
    #[error("expert {expert} of layer {layer}: {why}")]
    Invalid { layer: usize, expert: usize, why: String },
}

/// The model's only way to reach expert weights.
pub trait ExpertSource: Send + Sync {
    /// Layout of layer `layer`'s experts.
    fn layout(&self, layer: usize) -> &ExpertLayout;
    /// The router of `layer` chose `ids` (top-k rank order; for a batch, the union). Call
    /// `f(i, block)` exactly once for every `i in 0..ids.len()`, in any order (typically resident
    /// experts first, then misses as their bytes arrive).
    fn with_experts(&self, layer: usize, ids: &[u32], f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError>;
    /// As [`Self::with_experts`], but the caller already holds the experts for which `held`
    /// returns true (a GPU slot pool in front of this source): they count as hits and are not
    /// loaded or handed over; `f` is called only for the others (with their index in `ids`).
    fn with_experts_except(&self, layer: usize, ids: &[u32], held: &dyn Fn(u32) -> bool, f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError> {
        let rest: Vec<usize> = (0..ids.len()).filter(|&i| !held(ids[i])).collect();
        let sub: Vec<u32> = rest.iter().map(|&i| ids[i]).collect();
        self.with_experts(layer, &sub, &mut |ui, b| f(rest[ui], b))
    }
    /// A consumer with its own expert store in front of this source (a GPU slot pool) says which
    /// experts it holds, so prefetching skips them. The default ignores it.
    fn set_holder(&self, _holder: Arc<dyn ExpertHolder>) {}
    /// Lookahead hook: the input of layer `layer`'s FFN (after its norm) is known. Schedulers use
    /// it to predict and prefetch later layers' experts; the default does nothing.
    fn on_hidden(&self, _layer: usize, _h: &[f32], _n_tok: usize) {}
    /// Exact lookahead: layer `layer`'s router has chosen `ids` (the union over the forward's
    /// `n_tok` rows, top-k rank order) before the layer's attention runs (smallthinker's router
    /// reads the layer's input). The experts will be asked for by [`Self::with_experts`] once
    /// attention is done; a scheduler may start reading the missing ones now. The default does
    /// nothing.
    fn on_route(&self, _layer: usize, _ids: &[u32], _n_tok: usize) {}
    /// Lookahead hook: layer `layer`'s output (the residual stream after its FFN), last row
    /// only, `n_tok` rows in the forward. The default does nothing.
    fn on_residual(&self, _layer: usize, _x: &[f32], _n_tok: usize) {}
    /// Whether [`Self::on_residual`] is used: the model reads each layer's output back from a
    /// GPU only then (one synchronisation per layer).
    fn wants_residual(&self) -> bool {
        false
    }
    /// Lookahead hook (single-row forwards): layer `layer`'s output so far — the residual
    /// stream entering its FFN plus the weighted outputs of the experts handed over until now,
    /// called after the first of several. The default does nothing.
    fn on_partial(&self, _layer: usize, _x: &[f32]) {}
    /// The source's eviction policy's wish to keep expert `expert` of `layer` (higher: keep
    /// longer), or `None` for plain LRU. A consumer's own cache (the GPU slot pool) evicts the
    /// lowest, so the scheduler's policy ranks those slots as it ranks its own.
    fn retention(&self, _layer: usize, _expert: usize) -> Option<f64> {
        None
    }
    /// Lookahead from another model (a speculative draft): `rows[l]` holds the residual stream
    /// entering layer `l`'s FFN (before its norm), `n_rows × n_embd`, for the tokens the next
    /// forward will process. Schedulers may route these rows with the target's own routers to
    /// prefetch that forward's experts; the default ignores them.
    fn on_draft_hidden(&self, _rows: &[Vec<f32>]) {}
    /// Every expert is in memory here (no reads): a consumer with room for all of them (a GPU
    /// slot pool) may take them all at once.
    fn resident(&self) -> bool {
        false
    }
}

/// Which experts a consumer already holds (see [`ExpertSource::set_holder`]).
pub trait ExpertHolder: Send + Sync {
    fn holds(&self, layer: usize, expert: usize) -> bool;
}

/// Every expert resident in memory (the reference run).
pub struct ResidentExperts {
    layers: Vec<(ExpertLayout, Vec<Arc<ExpertBlock>>)>,
}

impl ResidentExperts {
    pub fn load(src: &dyn ByteSource, tensors: &[GgufExpertTensors], n_expert: usize) -> Result<Self, ExpertError> {
        let mut layers = Vec::with_capacity(tensors.len());
        for (il, t) in tensors.iter().enumerate() {
            let mut v = Vec::with_capacity(n_expert);
            for e in 0..n_expert {
                let b = ExpertBlock::read_from_gguf(src, t, e)
                    .map_err(|source| ExpertError::Store { layer: il, expert: e, source })?;
                v.push(Arc::new(b));
            }
            layers.push((t.layout.clone(), v));
        }
        let mut r = Self { layers };
        // The layout the CPU kernels read fastest, where it pays (wasm relaxed SIMD).
        r.repack(false);
        Ok(r)
    }
    /// [`ExpertBlock::repack`] every expert not shared elsewhere yet (all of them right after
    /// loading).
    pub fn repack(&mut self, always: bool) {
        for (_, v) in &mut self.layers {
            v.iter_mut().filter_map(Arc::get_mut).for_each(|b| b.repack(always));
        }
    }
    /// One layer, every expert read from `store`'s MoE layer `layer` (a bundle's: checksums
    /// verified).
    pub fn from_store(store: &dyn store::ExpertStore, layer: usize, n_expert: usize) -> Result<Self, ExpertError> {
        let layout = store.layout(layer).clone();
        let mut v = Vec::with_capacity(n_expert);
        for e in 0..n_expert {
            let mut data = Vec::new();
            store.read_expert(layer, e, &mut data)?;
            v.push(Arc::new(ExpertBlock::new(data, layout.clone())));
        }
        let mut r = Self { layers: vec![(layout, v)] };
        r.repack(false);
        Ok(r)
    }
    /// Total bytes of all experts.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(l, v)| l.bytes() * v.len()).sum()
    }
}

impl ExpertSource for ResidentExperts {
    fn layout(&self, layer: usize) -> &ExpertLayout {
        &self.layers[layer].0
    }
    fn resident(&self) -> bool {
        true
    }
    fn with_experts(&self, layer: usize, ids: &[u32], f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError> {
        let experts = &self.layers[layer].1;
        for (i, &e) in ids.iter().enumerate() {
            let b = experts.get(e as usize).ok_or_else(|| ExpertError::Invalid {
                layer,
                expert: e as usize,
                why: format!("only {} experts", experts.len()),
            })?;
            f(i, b);
        }
        Ok(())
    }
}

pub mod store;
pub mod stream;
pub mod coactivation;
pub mod policy;
pub mod stats;
mod queue;
pub mod governor;
pub mod io;
pub mod bundle;
