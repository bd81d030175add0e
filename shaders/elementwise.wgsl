// Element-wise kernels on f32 rows. Each keeps the CPU reference's exact operation order
// (src/backend/cpu/ops.rs, src/model/mod.rs):
//   add:      Y[i] += X[i]                                  (residual adds, biases with rows > 1)
//   swiglu:   Y[i] = silu(X[i]) * X2[i], silu(x) = x / (1 + ggml_expf(-x))   (ggml_vec_swiglu_f32)
//   reglu:    Y[i] = X[i] > 0 ? X[i] * X2[i] : 0             (ggml_vec_reglu_f32: smallthinker)
//   gather:   Y[r] = X[IDX[r]]                              (rows routed to one expert)
//   scatter:  Y[IDX[r]] = X[r] * WS[r]                      (expert outputs times router weights)
//   combine:  Y[t] = sum over ranks r in order of X[t*k + r] (fixed top-k order: lossless)
//   gate_add: Y[t] += X[t] * sigmoid(G[t])                  (qwen2moe shared expert, silu(g)/g)
//   gate_add_exp: the same with 1 / (1 + expf(-g))           (qwen35moe shared expert)
//   mul:      Y[i] *= X[i]                                   (lfm2's short-convolution gates)
//   mul_sigmoid: Y[i] *= 1 / (1 + expf(-X[i]))               (qwen35moe attention gate)
//   mul_silu: Y[i] *= silu(X[i])                             (Gated DeltaNet's gated norm)
// Products are rounded before any add and divisions round to nearest (exact.wgsl), as on the CPU.

struct Params {
    n: u32,        // values per row
    rows: u32,
    x_off: u32,
    y_off: u32,
    x2_off: u32,
    k: u32,        // combine: ranks per token; add: bias period (0 = none)
    idx_off: u32,  // gather/scatter: offset of the index (and weight) list in IDX (u32s)
    zero: u32,     // always 0 (exact.wgsl)
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> X2: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<storage, read> IDX: array<u32>;
@group(0) @binding(4) var<uniform> P: Params;

@compute @workgroup_size(64)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    var xi = i;
    if (P.k != 0u) { xi = i % P.k; }
    Y[P.y_off + i] = Y[P.y_off + i] + X[P.x_off + xi];
}

@compute @workgroup_size(64)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let g = X[P.x_off + i];
    Y[P.y_off + i] = div_rn(g, keep(1.0 + ggml_expf(-g))) * X2[P.x2_off + i];
}

// gpt-oss's swiglu_oai (ops::swiglu_oai, ggml `swiglu_oai`): x = min(g, limit),
// y = clamp(u, -limit, limit), x / (1 + expf(alpha * -x)) * (y + 1) with glibc's expf.
// alpha and limit arrive as the bits of P.k and P.idx_off.
@compute @workgroup_size(64)
fn swiglu_oai(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let alpha = bitcast<f32>(P.k);
    let limit = bitcast<f32>(P.idx_off);
    var x = X[P.x_off + i];
    if (limit < x) { x = limit; }
    let y = clamp(X2[P.x2_off + i], -limit, limit);
    let glu = div_rn(x, keep(1.0 + expf_glibc(keep(alpha * -x))));
    Y[P.y_off + i] = keep(glu * keep(y + 1.0));
}

@compute @workgroup_size(64)
fn reglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let g = X[P.x_off + i];
    var y = 0.0;
    if (g > 0.0) { y = keep(g * X2[P.x2_off + i]); }
    Y[P.y_off + i] = y;
}

@compute @workgroup_size(64)
fn gather(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let r = i / P.n;
    let c = i % P.n;
    Y[P.y_off + i] = X[P.x_off + IDX[P.idx_off + r] * P.n + c];
}

@compute @workgroup_size(64)
fn scatter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let r = i / P.n;
    let c = i % P.n;
    let w = bitcast<f32>(IDX[P.idx_off + P.rows + r]);
    Y[P.y_off + IDX[P.idx_off + r] * P.n + c] = X[P.x_off + i] * w;
}

@compute @workgroup_size(64)
fn combine(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let t = i / P.n;
    let c = i % P.n;
    var o = X[P.x_off + (t * P.k) * P.n + c];
    for (var r = 1u; r < P.k; r++) {
        o = keep(o + X[P.x_off + (t * P.k + r) * P.n + c]);
    }
    Y[P.y_off + i] = o;
}

// A decode token's routed experts weighted and combined in rank order: X holds P.k rows of P.n
// (rank order), IDX the k weights' bits. Each product rounded to f32 before the sum, as scatter
// (x * w stored) then combine compute it, and llama.cpp's `build_moe_ffn` (ggml_mul by the
// weights, then ggml_add over the experts in order).
@compute @workgroup_size(64)
fn combine_w(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let c = gid.x + gid.y * nw.x * 64u;
    if (c >= P.n) { return; }
    var o = keep(X[P.x_off + c] * bitcast<f32>(IDX[P.idx_off]));
    for (var r = 1u; r < P.k; r++) {
        o = keep(o + keep(X[P.x_off + r * P.n + c] * bitcast<f32>(IDX[P.idx_off + r])));
    }
    Y[P.y_off + c] = o;
}

// ggml `add_id`: for each pair r of IDX (row, expert), Y row `row` += X row `expert` (a routed
// expert's bias row), P.rows pairs, rows of P.n.
@compute @workgroup_size(64)
fn add_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let r = i / P.n;
    let c = i % P.n;
    let yi = P.y_off + IDX[P.idx_off + 2u * r] * P.n + c;
    Y[yi] = Y[yi] + X[P.x_off + IDX[P.idx_off + 2u * r + 1u] * P.n + c];
}

@compute @workgroup_size(64)
fn gate_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let t = i / P.n;
    // ops::sigmoid: silu(x) / x with glibc's expf, as llama.cpp's graph computes the gate.
    let x = X2[P.x2_off + t];
    let g = div_rn(div_rn(x, keep(1.0 + expf_glibc(-x))), x);
    Y[P.y_off + i] = Y[P.y_off + i] + keep(X[P.x_off + i] * g);
}

// expf: Y[i] = e^X[i] as glibc's expf (exact.wgsl), tested against the CPU's cmath::expf.
@compute @workgroup_size(64)
fn expf(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    Y[P.y_off + i] = expf_glibc(X[P.x_off + i]);
}

// ops::sigmoid_exp: 1 / (1 + expf(-x)) with glibc's expf (ggml's sigmoid op).
fn sigmoid_exp(x: f32) -> f32 {
    return div_rn(1.0, keep(1.0 + expf_glibc(-x)));
}

@compute @workgroup_size(64)
fn gate_add_exp(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let g = sigmoid_exp(X2[P.x2_off + i / P.n]);
    Y[P.y_off + i] = Y[P.y_off + i] + keep(X[P.x_off + i] * g);
}

@compute @workgroup_size(64)
fn mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    Y[P.y_off + i] = keep(Y[P.y_off + i] * X[P.x_off + i]);
}

@compute @workgroup_size(64)
fn mul_sigmoid(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    Y[P.y_off + i] = keep(Y[P.y_off + i] * sigmoid_exp(X[P.x_off + i]));
}

@compute @workgroup_size(64)
fn mul_silu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let z = X[P.x_off + i];
    Y[P.y_off + i] = keep(Y[P.y_off + i] * div_rn(z, keep(1.0 + ggml_expf(-z))));
}
