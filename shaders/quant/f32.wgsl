// F32 weights x F32 activations, four elements per "block" (rows are 4-byte aligned).
const WB: u32 = 16u;
const AB: u32 = 16u;
fn block_dot(w: u32, a: u32) -> f32 {
    let x = vec4<f32>(bitcast<f32>(W[w >> 2u]), bitcast<f32>(W[(w >> 2u) + 1u]), bitcast<f32>(W[(w >> 2u) + 2u]), bitcast<f32>(W[(w >> 2u) + 3u]));
    let y = vec4<f32>(bitcast<f32>(A[a >> 2u]), bitcast<f32>(A[(a >> 2u) + 1u]), bitcast<f32>(A[(a >> 2u) + 2u]), bitcast<f32>(A[(a >> 2u) + 3u]));
    return dot(x, y);
}
// Elements for the exact path (matvec_float_seq.wgsl): ES bytes each, at byte offset o.
const ES: u32 = 4u;
fn w_el(o: u32) -> f32 { return bitcast<f32>(W[o >> 2u]); }
fn a_el(o: u32) -> f32 { return bitcast<f32>(A[o >> 2u]); }
