// block_q5_K (176 B: d@0, dmin@2, scales[12]@4, qh[32]@16, qs[128]@48) x block_q8_K.
const WB: u32 = 176u;
const AB: u32 = 292u;
fn block_dot(w: u32, a: u32) -> f32 { return k45_dot(w, a, w + 48u, true); }
