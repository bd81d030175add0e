// matvec entry point: per-thread partial sums over blocks, then a shared-memory tree per row.
const WG: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let tpr = P.tpr;
    let row = (wid.x + wid.y * P.grid_x) * (WG / tpr) + lid / tpr;
    let lane = lid % tpr;
    let t = wid.z;
    var acc = 0.0;
    if (row < P.rows) {
        let wbase = w_base(t) + row * P.w_row_bytes;
        let abase = P.a_off + t_row(t) * P.a_row_bytes;
        for (var b = lane; b < P.n_blocks; b = b + tpr) {
            acc = keep(acc + keep(block_dot(wbase + b * WB, abase + b * AB)));
        }
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (s < tpr && lane < s) {
            partial[lid] = partial[lid] + partial[lid + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u && row < P.rows) {
        Y[P.y_off + t_row(t) * P.y_stride + row] = partial[lid];
    }
}
