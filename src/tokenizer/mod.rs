//! Tokenizers built from GGUF metadata (in progress).
