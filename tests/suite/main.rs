//! LES's integration tests, one module per concern, linked into one test binary (issue 35: one
//! link instead of one per file). They run with the kernels `Simd::best` picks for this CPU
//! (AVX2 follows llama.cpp's x86 summation orders: `reference` asserts its bits). Tests that
//! need the portable kernels for the whole process live in `tests/portable`.
//!
//!     cargo test --profile ci --test suite                 # all of them
//!     cargo test --profile ci --test suite -- reference::  # one module

#[path = "../common/mod.rs"]
mod common;

mod bundle;
mod c_abi;
mod chat_templates;
mod config;
mod context;
mod eval;
mod gguf;
mod mixed_precision;
mod plan;
mod quant;
mod quant_bench;
mod quantize;
mod reference;
mod speculative;
mod streaming;
mod tokenizer;
mod tokenizer_unicode;
mod vision;
mod wgpu_kernels;
mod wgpu_no_adapter;
