//! The CPU backend: ops written to follow ggml's CPU kernels (`ggml/src/ggml-cpu/ops.cpp`,
//! `vec.h`) — with AVX2 on x86-64, in llama.cpp's summation orders, so logits are bit-identical
//! to llama.cpp's there — and [`exec::CpuExec`], which runs them for the [`super::ops::Ops`]
//! contract.

pub mod cmath;
pub mod delta;
pub mod exec;
pub mod flash;
pub mod kv;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub mod lanes;
pub mod matmul;
pub mod ops;
pub mod par;
