//! `les bench gpu-probe`: the constants of the GPU cost model (`engine::gpu_cost`) measured on
//! the adapter at hand, so the first real device replaces the profiles' published figures:
//! - the idle synchronisation (a 4-byte readback: submit, `map_async`, wait; the GPU has nothing
//!   else to do);
//! - the cost of one dispatch (CPU recording plus GPU launch and barrier): many tiny dependent
//!   dispatches (`add` on 64 values, one compute pass, one submit) timed through one readback,
//!   less one idle sync, per dispatch;
//! - the bandwidth a matvec reaches: one token times a weight matrix of a given type (16 MiB),
//!   repeated in one submit, bytes of weights per second.

#[cfg(not(target_arch = "wasm32"))]
use super::{kernels::Kernels, GpuContext, GpuError, Recorder};
#[cfg(not(target_arch = "wasm32"))]
use crate::clock::now_ms;
#[cfg(not(target_arch = "wasm32"))]
use crate::quant::{vec_dot_type, GgmlType};

/// What [`probe`] measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuProbe {
    pub adapter: String,
    /// Idle GPU→CPU synchronisation, ms (median of the repetitions).
    pub sync_ms: f64,
    /// One dispatch, recording and running (µs).
    pub dispatch_us: f64,
    /// Weight bytes per second of a one-token matvec of `matvec_type`.
    pub bandwidth: f64,
    pub matvec_type: &'static str,
}

#[cfg(not(target_arch = "wasm32"))]
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

/// Measure the cost model's constants on `ctx` (native: it blocks on each readback).
#[cfg(not(target_arch = "wasm32"))]
pub fn probe(ctx: &GpuContext, ty: GgmlType, cols: usize) -> Result<GpuProbe, GpuError> {
    let k = Kernels::new(ctx);
    let arena = Recorder::arena_buffer(ctx);
    let mut rec = Recorder::new(ctx, &arena);
    let one = ctx.scratch("probe-one", 4)?;
    let mut sync = Vec::new();
    for i in 0..21 {
        let t0 = now_ms();
        super::block_on(rec.readback(&[(&one, 0, 4)]))?;
        if i > 0 {
            sync.push(now_ms() - t0);
        }
    }
    let sync_ms = median(sync);
    // Dispatches: each adds x into y (dependent on the one before).
    let (x, y) = (ctx.scratch("probe-x", 256)?, ctx.scratch("probe-y", 256)?);
    const N: usize = 2000;
    let mut per = Vec::new();
    for _ in 0..5 {
        let t0 = now_ms();
        for _ in 0..N {
            k.add(&mut rec, &x, 0, &y, 0, 64, 0);
        }
        super::block_on(rec.readback(&[(&y, 0, 4)]))?;
        per.push(((now_ms() - t0 - sync_ms).max(0.0)) * 1000.0 / N as f64);
    }
    let dispatch_us = median(per);
    // Matvec bandwidth: 16 MiB of `ty` weights of `cols` columns (a model's n_embd: matrices
    // that narrow run below a wide one's rate on some adapters), one token.
    let cols = cols.div_ceil(256).max(1) * 256;
    let row = ty.row_bytes(cols as u64).ok_or(GpuError::Unsupported(ty.name()))? as usize;
    let rows = ((16usize << 20) / row).max(1);
    let mut wq = Vec::new();
    let vals: Vec<f32> = (0..cols * rows).map(|i| ((i as u32).wrapping_mul(2654435761) >> 8) as f32 / (1u32 << 24) as f32 - 0.5).collect();
    crate::quant::quantize::quantize_weights(ty, &vals, &mut wq).map_err(|e| GpuError::Validation(e.to_string()))?;
    let w = ctx.upload("probe-w", &wq)?;
    let xs = ctx.upload("probe-act", bytemuck::cast_slice(&vals[..cols]))?;
    let vty = vec_dot_type(ty);
    let a = ctx.scratch("probe-a", vty.row_bytes(cols as u64).unwrap_or(4 * cols as u64) as usize + 4)?;
    let out = ctx.scratch("probe-out", 4 * rows)?;
    let act = if vty == GgmlType::F32 { &xs } else { &a };
    if vty != GgmlType::F32 {
        k.quant_act(&mut rec, vty, &xs, 0, cols, 1, &a, 0)?;
    }
    k.matvec(&mut rec, ty, cols, rows, &w, 0, act, 0, &out, 0, rows, 1)?;
    super::block_on(rec.readback(&[(&out, 0, 4)]))?;
    let reps = 8;
    let mut bw = Vec::new();
    for _ in 0..3 {
        let t0 = now_ms();
        for _ in 0..reps {
            k.matvec(&mut rec, ty, cols, rows, &w, 0, act, 0, &out, 0, rows, 1)?;
        }
        super::block_on(rec.readback(&[(&out, 0, 4)]))?;
        let s = ((now_ms() - t0 - sync_ms).max(1e-3)) / 1000.0;
        bw.push((wq.len() * reps) as f64 / s);
    }
    Ok(GpuProbe { adapter: format!("{} ({:?}, {:?})", ctx.info.name, ctx.info.backend, ctx.info.device_type), sync_ms, dispatch_us, bandwidth: median(bw), matvec_type: ty.name() })
}
