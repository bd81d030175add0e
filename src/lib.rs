//! LES: Lookahead Expert Scheduling.
//!
//! An inference engine for Mixture-of-Experts GGUF models on devices whose memory is smaller than
//! the model. See README.md for the design and ARCHITECTURE in NOTES.md for the module map.

pub mod clock;
pub mod gguf;
pub mod quant;
pub mod store;
pub mod tokenizer;
pub mod backend;
pub mod engine;
pub mod expert;
pub mod model;
pub mod vision;
#[cfg(not(target_arch = "wasm32"))]
pub mod ffi;
#[cfg(target_arch = "wasm32")]
pub mod wasm;
