// BF16 weights x BF16 activations (ggml_vec_dot_bf16), four elements per "block".
const WB: u32 = 8u;
const AB: u32 = 8u;
fn bf2(x: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(x << 16u), bitcast<f32>(x & 0xffff0000u)); }
fn block_dot(w: u32, a: u32) -> f32 {
    return dot(vec4<f32>(bf2(ww(w)), bf2(ww(w + 4u))), vec4<f32>(bf2(aw(a)), bf2(aw(a + 4u))));
}
// Elements for the exact path (matvec_float_seq.wgsl): ES bytes each, at byte offset o.
const ES: u32 = 2u;
fn w_el(o: u32) -> f32 { return bitcast<f32>(wu16(o) << 16u); }
fn a_el(o: u32) -> f32 { return bitcast<f32>(au16(o) << 16u); }
