//! CPU ops, written to follow ggml's CPU kernels (`ggml/src/ggml-cpu/ops.cpp`, `vec.h`) closely
//! enough that LES's logits match llama.cpp's to about 1e-2.

pub mod ops;
pub mod par;
pub mod matmul;
pub mod cmath;
