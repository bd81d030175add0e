// matvec entry point for F32 / F16 / BF16 weights on the exact path (one thread per row), in the
// CPU's order (src/quant/float.rs `dot_generic`): eight accumulators over 8-element steps, then
// ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)), then the remaining elements one by one.
// Each product is rounded before it is added (keep(), exact.wgsl), as in Rust.

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = (wid.x + wid.y * P.grid_x) * 64u + lid;
    let t = wid.z;
    if (row >= P.rows) {
        return;
    }
    let wbase = w_base(t) + row * P.w_row_bytes;
    let abase = P.a_off + t_row(t) * P.a_row_bytes;
    let n = P.n_blocks * 4u;
    let n8 = n & ~7u;
    var acc: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) {
        acc[k] = 0.0;
    }
    for (var i = 0u; i < n8; i += 8u) {
        for (var k = 0u; k < 8u; k++) {
            acc[k] = keep(acc[k] + keep(w_el(wbase + (i + k) * ES) * a_el(abase + (i + k) * ES)));
        }
    }
    var sum = keep(keep(keep(acc[0] + acc[4]) + keep(acc[1] + acc[5])) + keep(keep(acc[2] + acc[6]) + keep(acc[3] + acc[7])));
    for (var i = n8; i < n; i++) {
        sum = keep(sum + keep(w_el(wbase + i * ES) * a_el(abase + i * ES)));
    }
    Y[P.y_off + t_row(t) * P.y_stride + row] = sum;
}
