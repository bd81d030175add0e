// Element-wise kernels on f32 rows. Each keeps the CPU reference's exact operation order
// (src/backend/cpu/ops.rs, src/model/mod.rs):
//   add:      Y[i] += X[i]                                  (residual adds, biases with rows > 1)
//   swiglu:   Y[i] = silu(X[i]) * X2[i], silu(x) = x / (1 + ggml_expf(-x))   (ggml_vec_swiglu_f32)
//   gather:   Y[r] = X[IDX[r]]                              (rows routed to one expert)
//   scatter:  Y[IDX[r]] = X[r] * WS[r]                      (expert outputs times router weights)
//   combine:  Y[t] = sum over ranks r in order of X[t*k + r] (fixed top-k order: lossless)
//   gate_add: Y[t] += X[t] * sigmoid(G[t])                  (qwen2moe shared expert)

struct Params {
    n: u32,        // values per row
    rows: u32,
    x_off: u32,
    y_off: u32,
    x2_off: u32,
    k: u32,        // combine: ranks per token; add: bias period (0 = none)
    idx_off: u32,  // gather/scatter: offset of the index (and weight) list in IDX (u32s)
    _p0: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> X2: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<storage, read> IDX: array<u32>;
@group(0) @binding(4) var<uniform> P: Params;

var<private> P_INF_BITS: u32 = 0x7f800000u;

// ggml_v_expf / ggml_expf (ggml-cpu/vec.h, scalar form): exact port, so silu matches the CPU bit for bit.
fn ggml_expf(x: f32) -> f32 {
    // ggml adds and subtracts 0x1.8p23 to round x*log2(e) to an integer; shader compilers may
    // fold that pair away, so round() (ties to even, as the magic-number trick) is used instead.
    let n = round(x * bitcast<f32>(0x3fb8aa3bu));
    var b = fma(-n, bitcast<f32>(0x3f317200u), x);
    b = fma(-n, bitcast<f32>(0x35bfbe8eu), b);
    if (abs(n) > 192.0) {
        if (n <= 0.0) { return 0.0; }
        // +inf from a runtime value: WGSL rejects a constant expression that evaluates to inf.
        return bitcast<f32>(P_INF_BITS);
    }
    let u = b * b;
    let p = fma(bitcast<f32>(0x3c072010u), b, bitcast<f32>(0x3d2b9f17u));
    let q = fma(bitcast<f32>(0x3e2aaf33u), b, bitcast<f32>(0x3efffedbu));
    let lin = fma(bitcast<f32>(0x3f7ffff6u), b, 1.0);
    let j = fma(fma(p, u, q), u, lin);
    let ni = i32(n);
    let a = ni / 2;
    let c = ni - ni / 2;
    return j * bitcast<f32>(u32(clamp(a + 127, 1, 254)) << 23u) * bitcast<f32>(u32(clamp(c + 127, 1, 254)) << 23u);
}

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
    Y[P.y_off + i] = (g / (1.0 + ggml_expf(-g))) * X2[P.x2_off + i];
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
        o += X[P.x_off + (t * P.k + r) * P.n + c];
    }
    Y[P.y_off + i] = o;
}

@compute @workgroup_size(64)
fn gate_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let t = i / P.n;
    let g = 1.0 / (1.0 + exp(-X2[P.x2_off + t]));
    Y[P.y_off + i] = Y[P.y_off + i] + X[P.x_off + i] * g;
}
