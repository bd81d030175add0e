//! Rough profile of the wgpu backend: one kernel family at a time (development aid).
use les::backend::wgpu::kernels::Kernels;
use les::backend::wgpu::{block_on, GpuContext, Recorder};
use les::quant::GgmlType;
use std::time::Instant;

fn main() {
    let ctx = GpuContext::new().unwrap();
    let k = Kernels::new(&ctx);
    let arena = Recorder::arena_buffer(&ctx);
    let (cols, rows) = (1536usize, 576usize);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::F32] {
        let w = ctx.scratch("w", ty.row_bytes(cols as u64).unwrap() as usize * rows).unwrap();
        let a = ctx.scratch("a", 4 * cols * 2).unwrap();
        let y = ctx.scratch("y", 4 * rows).unwrap();
        let mut rec = Recorder::new(&ctx, &arena);
        let n = 50;
        k.matvec(&mut rec, ty, cols, rows, &w, 0, &a, 0, &y, 0, rows, 1).unwrap();
        block_on(rec.readback(&[(&y, 0, 4)])).unwrap();
        let t = Instant::now();
        for _ in 0..n {
            k.matvec(&mut rec, ty, cols, rows, &w, 0, &a, 0, &y, 0, rows, 1).unwrap();
        }
        block_on(rec.readback(&[(&y, 0, 4)])).unwrap();
        let ms = t.elapsed().as_secs_f64() * 1000.0 / n as f64;
        let bytes = ty.row_bytes(cols as u64).unwrap() as f64 * rows as f64;
        println!("matvec {:?} {rows}x{cols}: {ms:.3} ms ({:.2} GB/s)", ty, bytes / ms / 1e6);
    }
    // Attention: 9 heads, 3 kv heads, hd 64, 64 positions.
    let (nh, nkv, hd, nctx) = (9usize, 3usize, 64usize, 256usize);
    let q = ctx.scratch("q", 4 * nh * hd).unwrap();
    let kc = ctx.scratch("kc", 2 * nkv * nctx * hd).unwrap();
    let vc = ctx.scratch("vc", 2 * nkv * nctx * hd).unwrap();
    let o = ctx.scratch("o", 4 * nh * hd).unwrap();
    let sc = ctx.scratch("sc", 4 * nh * 65).unwrap();
    let mut rec = Recorder::new(&ctx, &arena);
    let n = 50;
    let t = Instant::now();
    for _ in 0..n {
        k.attention(&mut rec, &q, &kc, &vc, &o, &sc, nh, nkv, hd, nctx, 0, 63, 1, 0.125, 0, None);
    }
    block_on(rec.readback(&[(&o, 0, 4)])).unwrap();
    println!("attention 64 positions: {:.3} ms", t.elapsed().as_secs_f64() * 1000.0 / n as f64);
    let x = ctx.scratch("x", 4 * 576).unwrap();
    let y = ctx.scratch("y", 4 * 576).unwrap();
    let t = Instant::now();
    for _ in 0..n {
        k.add(&mut rec, &x, 0, &y, 0, 576, 0);
    }
    block_on(rec.readback(&[(&y, 0, 4)])).unwrap();
    println!("add 576 (dispatch overhead): {:.3} ms", t.elapsed().as_secs_f64() * 1000.0 / n as f64);
}
