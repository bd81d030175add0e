//! Experts on the GPU: a pool of fixed-size slots, each its own storage buffer (so each stays
//! within `maxStorageBufferBindingSize`; no whole-model buffers), holding one expert's gate, up and
//! down matrices back to back (4-byte aligned). The model asks the [`crate::expert::ExpertSource`]
//! for the routed experts exactly as on the CPU (hits first, misses as they arrive); each block it
//! hands over is uploaded into a slot unless that slot already holds it. Uploads go through
//! `queue.write_buffer` (wgpu copies through its staging belt in small chunks).
//!
//! A slot used by commands recorded but not yet submitted is never overwritten: `write_buffer`
//! lands before the next submit, so the recorder submits first when every free candidate is busy.

use super::{pad4, write_padded, GpuContext, GpuError, Recorder};
use crate::expert::ExpertBlock;
use std::collections::HashMap;

/// Byte offsets of the three matrices in a slot.
#[derive(Clone, Copy, Debug)]
pub struct SlotLayout {
    pub gate: u64,
    pub up: u64,
    pub down: u64,
}

impl SlotLayout {
    /// Slot bytes an expert of this layout needs.
    pub fn bytes_for(l: &crate::expert::ExpertLayout) -> usize {
        pad4(l.gate_bytes) + pad4(l.up_bytes) + pad4(l.down_bytes)
    }

    pub fn of(blk: &ExpertBlock) -> (Self, usize) {
        (Self::of_layout(&blk.layout), Self::bytes_for(&blk.layout))
    }

    pub fn of_layout(l: &crate::expert::ExpertLayout) -> Self {
        Self { gate: 0, up: pad4(l.gate_bytes) as u64, down: (pad4(l.gate_bytes) + pad4(l.up_bytes)) as u64 }
    }
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PoolStats {
    pub hits: u64,
    pub uploads: u64,
    pub upload_bytes: u64,
    /// Submits forced because every slot was busy in the current recording.
    pub forced_submits: u64,
}

/// The set of (layer, expert) in GPU slots, shared with the expert source so it does not prefetch
/// what the GPU already holds.
#[derive(Default)]
pub struct HeldSet(std::sync::RwLock<std::collections::HashSet<(usize, usize)>>);

impl crate::expert::ExpertHolder for HeldSet {
    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.0.read().unwrap().contains(&(layer, expert))
    }
}

pub struct GpuExpertPool {
    /// Mirror of `map`'s keys for the expert source.
    pub held: std::sync::Arc<HeldSet>,
    slot_bytes: usize,
    slots: Vec<wgpu::Buffer>,
    owner: Vec<Option<(usize, usize)>>,
    /// Shapes and types of the expert each slot holds.
    layouts: Vec<Option<crate::expert::ExpertLayout>>,
    map: HashMap<(usize, usize), usize>,
    last_use: Vec<u64>,
    /// `rec.submits` value when the slot was last used (busy while equal to the current value).
    used_in: Vec<Option<usize>>,
    tick: u64,
    pub stats: PoolStats,
}

impl GpuExpertPool {
    /// `n_slots` slots of `slot_bytes` each.
    pub fn new(ctx: &GpuContext, n_slots: usize, slot_bytes: usize) -> Result<Self, GpuError> {
        let slot_bytes = pad4(slot_bytes);
        if slot_bytes as u64 > ctx.max_binding() {
            return Err(GpuError::Limit { what: "one expert slot (gate + up + down)".into(), need: slot_bytes as u64, have: ctx.max_binding() });
        }
        let n_slots = n_slots.max(1);
        let slots = (0..n_slots).map(|i| Self::slot(ctx, i, slot_bytes)).collect();
        Ok(Self {
            held: Default::default(),
            slot_bytes,
            slots,
            owner: vec![None; n_slots],
            layouts: vec![None; n_slots],
            map: HashMap::new(),
            last_use: vec![0; n_slots],
            used_in: vec![None; n_slots],
            tick: 0,
            stats: PoolStats::default(),
        })
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    /// Resize to `n` slots (at least 1): fewer drop the last slots and the experts in them
    /// (commands already recorded keep their buffers alive until they have run: wgpu counts the
    /// references), more add empty ones.
    pub fn resize(&mut self, ctx: &GpuContext, n: usize) {
        let n = n.max(1);
        while self.slots.len() > n {
            let s = self.slots.len() - 1;
            if let Some(old) = self.owner[s].take() {
                self.map.remove(&old);
                self.held.0.write().unwrap().remove(&old);
            }
            self.slots.pop();
            self.owner.pop();
            self.layouts.pop();
            self.last_use.pop();
            self.used_in.pop();
        }
        while self.slots.len() < n {
            let i = self.slots.len();
            self.slots.push(Self::slot(ctx, i, self.slot_bytes));
            self.owner.push(None);
            self.layouts.push(None);
            self.last_use.push(0);
            self.used_in.push(None);
        }
    }

    fn slot(ctx: &GpuContext, i: usize, bytes: usize) -> wgpu::Buffer {
        ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some(&format!("expert-slot-{i}")),
            size: bytes as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn buffer(&self, slot: usize) -> &wgpu::Buffer {
        &self.slots[slot]
    }

    /// Whether expert `ex` of `layer` is in a slot.
    pub fn holds(&self, layer: usize, ex: usize) -> bool {
        self.map.contains_key(&(layer, ex))
    }

    /// The slot holding expert `ex` of `layer` and its layout, marking it used (a hit).
    pub fn hit(&mut self, rec: &Recorder<'_>, layer: usize, ex: usize) -> Option<(usize, crate::expert::ExpertLayout)> {
        let s = *self.map.get(&(layer, ex))?;
        self.tick += 1;
        self.stats.hits += 1;
        self.last_use[s] = self.tick;
        self.used_in[s] = Some(rec.submits);
        Some((s, self.layouts[s].clone()?))
    }

    /// The slot holding expert `ex` of `layer`, uploading `blk` into a free slot or, when none is
    /// free, the one whose expert `retention` ranks lowest (the expert source's policy; `None`
    /// scores: least recently used first).
    pub fn ensure(&mut self, rec: &mut Recorder<'_>, layer: usize, ex: usize, blk: &ExpertBlock, retention: &dyn Fn(usize, usize) -> Option<f64>) -> Result<usize, GpuError> {
        self.tick += 1;
        if let Some(&s) = self.map.get(&(layer, ex)) {
            self.stats.hits += 1;
            self.last_use[s] = self.tick;
            self.used_in[s] = Some(rec.submits);
            return Ok(s);
        }
        let (_, bytes) = SlotLayout::of(blk);
        if bytes > self.slot_bytes {
            return Err(GpuError::Limit { what: format!("expert {ex} of layer {layer}"), need: bytes as u64, have: self.slot_bytes as u64 });
        }
        let pick = |me: &Self, now: usize| -> Option<usize> {
            let key = |s: usize| -> (bool, f64, u64) {
                let score = me.owner[s].and_then(|(l, e)| retention(l, e)).unwrap_or(0.0);
                (me.owner[s].is_some(), score, me.last_use[s])
            };
            (0..me.slots.len()).filter(|&s| me.used_in[s] != Some(now)).min_by(|&a, &b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal))
        };
        let s = match pick(self, rec.submits) {
            Some(s) => s,
            None => {
                rec.submit();
                self.stats.forced_submits += 1;
                pick(self, rec.submits).expect("no busy slots after a submit")
            }
        };
        if let Some(old) = self.owner[s].take() {
            self.map.remove(&old);
            self.held.0.write().unwrap().remove(&old);
        }
        let (lay, _) = SlotLayout::of(blk);
        let q = rec.ctx;
        write_padded(q, &self.slots[s], lay.gate, &blk.file_bytes(0));
        write_padded(q, &self.slots[s], lay.up, &blk.file_bytes(1));
        write_padded(q, &self.slots[s], lay.down, &blk.file_bytes(2));
        self.owner[s] = Some((layer, ex));
        self.layouts[s] = Some(blk.layout.clone());
        self.map.insert((layer, ex), s);
        self.held.0.write().unwrap().insert((layer, ex));
        self.last_use[s] = self.tick;
        self.used_in[s] = Some(rec.submits);
        self.stats.uploads += 1;
        self.stats.upload_bytes += bytes as u64;
        Ok(s)
    }
}
