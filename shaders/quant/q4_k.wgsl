// block_q4_K (144 B: d@0, dmin@2, scales[12]@4, qs[128]@16) x block_q8_K:
// d*sum(scale*dot) - dmin*sum(min*bsum), with d, dmin times d_a.
const WB: u32 = 144u;
const AB: u32 = 292u;
fn block_dot(w: u32, a: u32) -> f32 { return k45_dot(w, a, w + 16u, false); }
