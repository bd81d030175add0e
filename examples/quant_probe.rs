//! Cross-platform numerics probe: quantize `x` (f32 file) to the activation type of ggml type
//! `TY` and dot it with each row of `w` (raw weight bytes). Prints the dots' bits and the
//! activation bytes' FNV hash, to compare with the wasm build's `debugMatvec` on the same files.
//! Usage: cargo run --release --example quant_probe -- TY W_FILE X_FILE
//!        cargo run --release --example quant_probe -- f32ops X_FILE
//!        cargo run --release --example quant_probe -- matmul TYPE_ID W_FILE X_FILE COLS
//! (`f32ops`: the bits of `backend::cpu::ops::numerics_probe(x)`, one per line, for the wasm
//! build's `debugF32Ops`; `matmul`: those of `backend::cpu::matmul::matmul_probe`, for
//! `debugMatmul`.)
use les::quant::{self, GgmlType};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a[1] == "matmul" {
        let w = std::fs::read(&a[3]).unwrap();
        let xb = std::fs::read(&a[4]).unwrap();
        let x: Vec<f32> = xb.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        for v in les::backend::cpu::matmul::matmul_probe(a[2].parse().unwrap(), &w, &x, a[5].parse().unwrap(), false) {
            println!("{:08x}", v.to_bits());
        }
        return;
    }
    if a[1] == "f32ops" {
        let xb = std::fs::read(&a[2]).unwrap();
        let x: Vec<f32> = xb.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        for v in les::backend::cpu::ops::numerics_probe(&x) {
            println!("{:08x}", v.to_bits());
        }
        return;
    }
    let t = GgmlType::from_u32(a[1].parse().unwrap()).unwrap();
    let w = std::fs::read(&a[2]).unwrap();
    let xb = std::fs::read(&a[3]).unwrap();
    let x: Vec<f32> = xb.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let mut act = Vec::new();
    quant::quantize_activation(quant::vec_dot_type(t), &x, &mut act).unwrap();
    let rb = t.row_bytes(x.len() as u64).unwrap() as usize;
    let mut y = vec![0f32; w.len() / rb];
    quant::matvec(t, x.len(), &w, &act, &mut y);
    let h = act.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &v| (h ^ v as u64).wrapping_mul(0x100_0000_01b3));
    println!("act {h:016x}");
    for v in y {
        println!("{:08x}", v.to_bits());
    }
}
