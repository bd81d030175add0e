//! Integration tests that compute with the portable kernels (`Simd::force(Simd::Scalar)`: what
//! wasm32, aarch64 and the wgpu backend's exact path compute bit for bit). The kernel level is
//! one setting per process, so these share a test binary of their own, apart from
//! `tests/suite` (whose `reference` tests need llama.cpp's x86 kernels).
//!
//!     cargo test --profile ci --test portable
//!     LES_FULL_TESTS=1 cargo test --profile ci --test portable -- wgpu_model::   # the long matrix

#[path = "../common/mod.rs"]
mod common;

mod conversation;
mod gpu_counts;
mod ops;
mod repack;
mod serve;
mod wgpu_model;
