// BF16 weights x BF16 activations (ggml_vec_dot_bf16), one element per "block".
const WB: u32 = 2u;
const AB: u32 = 2u;
fn block_dot(w: u32, a: u32) -> f32 { return bf16_bits_to_f32(wu16(w)) * bf16_bits_to_f32(au16(a)); }
