// F16 weights x F16 activations (ggml_vec_dot_f16), four elements per "block". f16 -> f32 is exact.
const WB: u32 = 8u;
const AB: u32 = 8u;
fn block_dot(w: u32, a: u32) -> f32 {
    let x0 = unpack2x16float(ww(w));
    let x1 = unpack2x16float(ww(w + 4u));
    let y0 = unpack2x16float(aw(a));
    let y1 = unpack2x16float(aw(a + 4u));
    return dot(vec4<f32>(x0, x1), vec4<f32>(y0, y1));
}
// Elements for the exact path (matvec_float_seq.wgsl): ES bytes each, at byte offset o.
const ES: u32 = 2u;
fn w_el(o: u32) -> f32 { return wf16(o); }
fn a_el(o: u32) -> f32 { return af16(o); }
