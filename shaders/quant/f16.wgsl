// F16 weights x F16 activations (ggml_vec_dot_f16), one element per "block".
const WB: u32 = 2u;
const AB: u32 = 2u;
fn block_dot(w: u32, a: u32) -> f32 { return wf16(w) * af16(a); }
