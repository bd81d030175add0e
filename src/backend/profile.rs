//! Per-op wall time of a forward pass (`les bench pp-tg --profile`): [`Profiled`] wraps any
//! [`Ops`] and adds each op's time to a process-wide table while [`enable`]d. On the CPU an op's
//! time is its compute (every op runs when called, its parallel sections included); on wgpu it
//! would be recording time only, so the CPU forward is the one that uses it. Ops are labelled by
//! name, and matrix products by count and shape (`matmul ×3 576→576`: three products of a
//! 576-wide input, the first 576 wide), which tells attention, FFN, router and output apart.

use super::ops::{Attn, DeltaNet, ExpertFfn, Gelu, Mat, OpError, Ops, Rope, Route, RouteSpec, SelfAttn, Sigmoid, Vector};
use crate::expert::ExpertSource;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static ON: AtomicBool = AtomicBool::new(false);
static TABLE: Mutex<BTreeMap<String, (u64, f64)>> = Mutex::new(BTreeMap::new());

/// Start (clearing the table) or stop recording.
pub fn enable(on: bool) {
    if on {
        TABLE.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
    ON.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// One row of the table: label, calls, total milliseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    pub op: String,
    pub calls: u64,
    pub ms: f64,
}

/// The table so far, slowest first (recording goes on).
pub fn table() -> Vec<OpTime> {
    let t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<OpTime> = t.iter().map(|(k, &(calls, ms))| OpTime { op: k.clone(), calls, ms }).collect();
    v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    v
}

/// Add `ms` to `op`'s row (a forward's total is recorded as `forward`).
pub fn record(op: &str, ms: f64) {
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let e = t.entry(op.to_string()).or_insert((0, 0.0));
    e.0 += 1;
    e.1 += ms;
}

/// An [`Ops`] that times each op of `inner`.
pub struct Profiled<'a, B: Ops>(pub &'a mut B);

fn timed<R>(op: &str, f: impl FnOnce() -> R) -> R {
    let t0 = crate::clock::now_ms();
    let r = f();
    record(op, crate::clock::now_ms() - t0);
    r
}

impl<B: Ops> Ops for Profiled<'_, B> {
    type T = B::T;

    const BACKEND: &'static str = B::BACKEND;

    fn shape(t: &B::T) -> (usize, usize) {
        B::shape(t)
    }
    fn input(&mut self, x: Vec<f32>, cols: usize) -> Result<B::T, OpError> {
        timed("input", || self.0.input(x, cols))
    }
    fn rms_norm(&mut self, x: &B::T, w: Vector, eps: f32) -> Result<B::T, OpError> {
        timed("rms_norm", || self.0.rms_norm(x, w, eps))
    }
    fn rms_norm_groups(&mut self, x: &mut B::T, w: Vector, eps: f32) -> Result<(), OpError> {
        timed("rms_norm_groups", || self.0.rms_norm_groups(x, w, eps))
    }
    fn matmul(&mut self, x: &B::T, ws: &[Mat]) -> Result<Vec<B::T>, OpError> {
        let t0 = crate::clock::now_ms();
        let r = self.0.matmul(x, ws)?;
        let out = r.first().map(|y| B::shape(y).1).unwrap_or(0);
        record(&format!("matmul ×{} {}→{out}", ws.len(), B::shape(x).1), crate::clock::now_ms() - t0);
        Ok(r)
    }
    fn add_row(&mut self, x: &mut B::T, b: Vector) -> Result<(), OpError> {
        timed("add_row", || self.0.add_row(x, b))
    }
    fn add(&mut self, x: &mut B::T, y: &B::T) -> Result<(), OpError> {
        timed("add", || self.0.add(x, y))
    }
    fn rope(&mut self, x: &mut B::T, pos0: usize, p: &Rope) -> Result<(), OpError> {
        timed("rope", || self.0.rope(x, pos0, p))
    }
    fn attention(&mut self, il: usize, q: &B::T, k: &B::T, v: &B::T, pos0: usize, p: &Attn) -> Result<B::T, OpError> {
        timed("attention", || self.0.attention(il, q, k, v, pos0, p))
    }
    fn swiglu(&mut self, g: &B::T, u: &B::T) -> Result<B::T, OpError> {
        timed("swiglu", || self.0.swiglu(g, u))
    }
    fn gate_add(&mut self, x: &mut B::T, y: &B::T, g: &B::T, f: Sigmoid) -> Result<(), OpError> {
        timed("gate_add", || self.0.gate_add(x, y, g, f))
    }
    fn mul_sigmoid(&mut self, x: &mut B::T, g: &B::T) -> Result<(), OpError> {
        timed("mul_sigmoid", || self.0.mul_sigmoid(x, g))
    }
    fn mul(&mut self, x: &mut B::T, y: &B::T) -> Result<(), OpError> {
        timed("mul", || self.0.mul(x, y))
    }
    fn ssm_conv(&mut self, il: usize, x: &B::T, w: Vector, d_conv: usize, silu: bool) -> Result<B::T, OpError> {
        timed("ssm_conv", || self.0.ssm_conv(il, x, w, d_conv, silu))
    }
    fn delta_net(&mut self, il: usize, x: &mut B::T, alpha: &B::T, beta: &B::T, p: &DeltaNet) -> Result<B::T, OpError> {
        timed("delta_net", || self.0.delta_net(il, x, alpha, beta, p))
    }
    fn norm_gated(&mut self, x: &mut B::T, w: Vector, z: &B::T, eps: f32) -> Result<(), OpError> {
        timed("norm_gated", || self.0.norm_gated(x, w, z, eps))
    }
    fn last_row(&mut self, x: B::T) -> Result<B::T, OpError> {
        timed("last_row", || self.0.last_row(x))
    }
    fn experts(&mut self, il: usize, src: &dyn ExpertSource, x: &B::T, r: Route<'_>, f: &ExpertFfn, partial: Option<&B::T>) -> Result<B::T, OpError> {
        timed("experts", || self.0.experts(il, src, x, r, f, partial))
    }
    fn routes_on_device(&mut self, il: usize, src: &dyn ExpertSource, n_expert: usize) -> bool {
        self.0.routes_on_device(il, src, n_expert)
    }
    fn experts_routed(&mut self, il: usize, src: &dyn ExpertSource, x: &B::T, logits: &B::T, spec: &RouteSpec, sel_bias: Option<Vector>, f: &ExpertFfn) -> Result<B::T, OpError> {
        timed("experts_routed", || self.0.experts_routed(il, src, x, logits, spec, sel_bias, f))
    }
    fn layer_norm(&mut self, x: &B::T, w: Vector, b: Option<Vector>, eps: f32) -> Result<B::T, OpError> {
        timed("layer_norm", || self.0.layer_norm(x, w, b, eps))
    }
    fn gelu(&mut self, x: &mut B::T, kind: Gelu) -> Result<(), OpError> {
        timed("gelu", || self.0.gelu(x, kind))
    }
    fn self_attention(&mut self, q: &B::T, k: &B::T, v: &B::T, p: &SelfAttn) -> Result<B::T, OpError> {
        timed("self_attention", || self.0.self_attention(q, k, v, p))
    }
    fn gather_rows(&mut self, x: &B::T, idx: &[u32]) -> Result<B::T, OpError> {
        timed("gather_rows", || self.0.gather_rows(x, idx))
    }
    fn concat_cols(&mut self, xs: &[&B::T]) -> Result<B::T, OpError> {
        timed("concat_cols", || self.0.concat_cols(xs))
    }
    fn scale(&mut self, x: &mut B::T, s: f32) -> Result<(), OpError> {
        timed("scale", || self.0.scale(x, s))
    }
    async fn read(&mut self, parts: &[(&B::T, Range<usize>)]) -> Result<Vec<Vec<f32>>, OpError> {
        let t0 = crate::clock::now_ms();
        let r = self.0.read(parts).await;
        record("read", crate::clock::now_ms() - t0);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_calls_and_sorts_slowest_first() {
        enable(true);
        record("a", 1.0);
        record("b", 3.0);
        record("a", 1.5);
        let t = table();
        enable(false);
        let a = t.iter().find(|r| r.op == "a").unwrap();
        assert_eq!((a.calls, a.ms), (2, 2.5));
        let ib = t.iter().position(|r| r.op == "b").unwrap();
        let ia = t.iter().position(|r| r.op == "a").unwrap();
        assert!(ib < ia, "slowest first: {t:?}");
    }
}
