//! Experts on the GPU: a pool of fixed-size slots in a few large slab buffers (each slab within
//! `maxStorageBufferBindingSize`, so one binding reaches every slot of it; no whole-model
//! buffers), each slot holding one expert's gate, up and down matrices back to back (4-byte
//! aligned). A decode token's routed experts in one slab run together: the expert kernels take
//! their slots' byte offsets from a list ([`crate::backend::wgpu::kernels::Kernels::matvec_id`],
//! as ggml's `mul_mat_id` takes expert ids). The model asks the [`crate::expert::ExpertSource`]
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
    /// Slots per slab (the last slab may hold fewer).
    per_slab: usize,
    slabs: Vec<wgpu::Buffer>,
    n_slots: usize,
    owner: Vec<Option<(usize, usize)>>,
    /// Shapes and types of the expert each slot holds.
    layouts: Vec<Option<crate::expert::ExpertLayout>>,
    map: HashMap<(usize, usize), usize>,
    last_use: Vec<u64>,
    /// `rec.submits` value when the slot was last used (busy while equal to the current value).
    used_in: Vec<Option<usize>>,
    tick: u64,
    pub stats: PoolStats,
    /// `slot_of[layer * n_expert + expert]`: the slot's byte offset in its slab, or `u32::MAX`
    /// (route.wgsl reads it), and how many experts each layer has in slots.
    table: Option<(wgpu::Buffer, usize)>,
    per_layer: Vec<usize>,
}

impl GpuExpertPool {
    /// `n_slots` slots of `slot_bytes` each.
    pub fn new(ctx: &GpuContext, n_slots: usize, slot_bytes: usize) -> Result<Self, GpuError> {
        let slot_bytes = pad4(slot_bytes);
        if slot_bytes as u64 > ctx.max_binding() {
            return Err(GpuError::Limit { what: "one expert slot (gate + up + down)".into(), need: slot_bytes as u64, have: ctx.max_binding() });
        }
        let n_slots = n_slots.max(1);
        let per_slab = ((ctx.max_binding() as usize) / slot_bytes).max(1);
        let slabs = Self::slabs(ctx, 0, n_slots, per_slab, slot_bytes);
        Ok(Self {
            held: Default::default(),
            slot_bytes,
            per_slab,
            slabs,
            n_slots,
            owner: vec![None; n_slots],
            layouts: vec![None; n_slots],
            map: HashMap::new(),
            last_use: vec![0; n_slots],
            used_in: vec![None; n_slots],
            tick: 0,
            stats: PoolStats::default(),
            table: None,
            per_layer: Vec::new(),
        })
    }

    /// Keep a device table of where each (layer, expert) is (`slot_of`, for routing on the GPU).
    pub fn set_table(&mut self, ctx: &GpuContext, n_layer: usize, n_expert: usize) -> Result<(), GpuError> {
        let mut init = vec![u32::MAX; (n_layer * n_expert).max(1)];
        self.per_layer = vec![0; n_layer];
        for (&(l, e), &s) in &self.map {
            if l < n_layer && e < n_expert {
                init[l * n_expert + e] = self.buffer(s).2 as u32;
                self.per_layer[l] += 1;
            }
        }
        let buf = ctx.upload("expert-slot-table", bytemuck::cast_slice(&init))?;
        self.table = Some((buf, n_expert));
        Ok(())
    }

    /// The slot table (see [`Self::set_table`]).
    pub fn table(&self) -> Option<&wgpu::Buffer> {
        self.table.as_ref().map(|t| &t.0)
    }

    /// Whether every one of layer `layer`'s `n_expert` experts is in a slot of a single slab
    /// (the pool's only one), so a kernel can reach any of them through one binding, each with
    /// the layer's `layout` (the offsets and types the kernels are given).
    pub fn holds_layer(&self, layer: usize, n_expert: usize, layout: &crate::expert::ExpertLayout) -> bool {
        self.holds_layer_slots(layer, n_expert) && (0..n_expert).all(|e| self.map.get(&(layer, e)).is_some_and(|&s| self.layouts[s].as_ref() == Some(layout)))
    }

    /// [`Self::holds_layer`] without the layouts (their check is the costly part: one lookup
    /// per expert).
    pub fn holds_layer_slots(&self, layer: usize, n_expert: usize) -> bool {
        self.slabs.len() == 1 && self.table.is_some() && self.per_layer.get(layer) == Some(&n_expert)
    }

    /// Record in the table that (layer, ex) is at `slot`, or gone (`None`).
    fn set_entry(&mut self, ctx: &GpuContext, layer: usize, ex: usize, slot: Option<usize>) {
        let off = slot.map(|s| self.buffer(s).2 as u32);
        if let Some((buf, n_expert)) = &self.table {
            if ex < *n_expert && layer < self.per_layer.len() {
                ctx.write(buf, 4 * (layer * n_expert + ex) as u64, bytemuck::bytes_of(&off.unwrap_or(u32::MAX)));
                if off.is_some() {
                    self.per_layer[layer] += 1;
                } else {
                    self.per_layer[layer] -= 1;
                }
            }
        }
    }

    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Resize to `n` slots (at least 1). The slabs from the first one whose size changes are
    /// made anew, and the experts they held dropped (commands already recorded keep the old
    /// buffers alive until they have run: wgpu counts the references); the others keep theirs.
    pub fn resize(&mut self, ctx: &GpuContext, n: usize) {
        let n = n.max(1);
        if n == self.n_slots {
            return;
        }
        let keep_slabs = n.min(self.n_slots) / self.per_slab;
        let first = keep_slabs * self.per_slab;
        for s in first..self.n_slots {
            if let Some(old) = self.owner[s].take() {
                self.map.remove(&old);
                self.held.0.write().unwrap().remove(&old);
                self.set_entry(ctx, old.0, old.1, None);
            }
        }
        self.slabs.truncate(keep_slabs);
        self.slabs.extend(Self::slabs(ctx, first, n, self.per_slab, self.slot_bytes));
        self.owner.resize(n, None);
        self.layouts.resize(n, None);
        self.last_use.resize(n, 0);
        self.used_in.resize(n, None);
        for s in first..n {
            (self.owner[s], self.layouts[s], self.last_use[s], self.used_in[s]) = (None, None, 0, None);
        }
        self.n_slots = n;
    }

    /// Slab buffers for slots `from..to` (`from` a multiple of `per_slab`).
    fn slabs(ctx: &GpuContext, from: usize, to: usize, per_slab: usize, slot_bytes: usize) -> Vec<wgpu::Buffer> {
        (from..to)
            .step_by(per_slab)
            .map(|s| {
                let n = per_slab.min(to - s);
                ctx.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(&format!("expert-slab-{}", s / per_slab)),
                    size: (n * slot_bytes) as u64,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })
            .collect()
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slab `b`'s buffer.
    pub fn slab(&self, b: usize) -> &wgpu::Buffer {
        &self.slabs[b]
    }

    /// The slab holding `slot`, its index, and the slot's byte offset in it.
    pub fn buffer(&self, slot: usize) -> (&wgpu::Buffer, usize, u64) {
        let b = slot / self.per_slab;
        (&self.slabs[b], b, ((slot % self.per_slab) * self.slot_bytes) as u64)
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

    /// Upload every expert of `src`'s `n_layer` layers (`n_expert` each), one submit per layer;
    /// with fewer slots than that, the later ones evict the least recently used.
    pub fn fill(&mut self, rec: &mut Recorder<'_>, n_layer: usize, n_expert: usize, src: &dyn crate::expert::ExpertSource) -> Result<(), GpuError> {
        let ids: Vec<u32> = (0..n_expert as u32).collect();
        let mut err = None;
        for il in 0..n_layer {
            src.with_experts(il, &ids, &mut |i, blk| {
                if err.is_none() {
                    err = self.ensure(rec, il, i, blk, &|_, _| None).err();
                }
            })
            .map_err(|e| GpuError::Validation(e.to_string()))?;
            rec.submit();
        }
        err.map_or(Ok(()), Err)
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
            (0..me.n_slots).filter(|&s| me.used_in[s] != Some(now)).min_by(|&a, &b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal))
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
            self.set_entry(rec.ctx, old.0, old.1, None);
        }
        let (lay, _) = SlotLayout::of(blk);
        let q = rec.ctx;
        let (slab, _, base) = self.buffer(s);
        write_padded(q, slab, base + lay.gate, &blk.file_bytes(0));
        write_padded(q, slab, base + lay.up, &blk.file_bytes(1));
        write_padded(q, slab, base + lay.down, &blk.file_bytes(2));
        self.owner[s] = Some((layer, ex));
        self.layouts[s] = Some(blk.layout.clone());
        self.map.insert((layer, ex), s);
        self.held.0.write().unwrap().insert((layer, ex));
        self.set_entry(rec.ctx, layer, ex, Some(s));
        self.last_use[s] = self.tick;
        self.used_in[s] = Some(rec.submits);
        self.stats.uploads += 1;
        self.stats.upload_bytes += bytes as u64;
        Ok(s)
    }
}
