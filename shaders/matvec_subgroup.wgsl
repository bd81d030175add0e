// matvec entry point for adapters with subgroups, one row per workgroup (tpr = 64): per-thread
// partial sums over blocks, subgroupAdd inside each subgroup, then the subgroup sums in order.
// (Naga takes subgroup builtins without an `enable subgroups;` directive once the device has the
// SUBGROUP feature; it rejects the directive itself.)

const WG: u32 = 64u;
var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_invocation_id) sid: u32, @builtin(subgroup_size) ssz: u32) {
    let row = wid.x + wid.y * P.grid_x;
    let t = wid.z;
    var acc = 0.0;
    if (row < P.rows) {
        let wbase = w_base(t) + row * P.w_row_bytes;
        let abase = P.a_off + t_row(t) * P.a_row_bytes;
        for (var b = lid; b < P.n_blocks; b = b + WG) {
            acc = keep(acc + keep(block_dot(wbase + b * WB, abase + b * AB)));
        }
    }
    let s = subgroupAdd(acc);
    if (sid == 0u) {
        partial[lid / ssz] = s;
    }
    workgroupBarrier();
    if (lid == 0u && row < P.rows) {
        var total = 0.0;
        for (var i = 0u; i < WG / ssz; i++) {
            total += partial[i];
        }
        Y[P.y_off + t_row(t) * P.y_stride + row] = total;
    }
}
