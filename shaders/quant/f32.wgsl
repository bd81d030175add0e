// F32 weights x F32 activations, one element per "block".
const WB: u32 = 4u;
const AB: u32 = 4u;
fn block_dot(w: u32, a: u32) -> f32 { return bitcast<f32>(wu32(w)) * af32(a); }
