// RMSNorm (llama.cpp `ggml_rms_norm` then `ggml_mul` by the weight): for each row of n values,
// y = (x * (1 / sqrt(mean(x^2) + eps))) * w. The CPU reference sums the f32 squares in f64
// (ggml_float) and rounds the mean to f32; here they are summed in double-f32 (exact.wgsl: 64
// strided partial sums, then a tree), which rounds to the same f32 mean except within about
// 2^-46 of a rounding boundary.
// Rows are `n_groups` groups of n values per token (n_groups > 1: per-head Q/K norms). With
// `per_tok` > 0 (`inplace` only) row r starts at x_off + (r / per_tok) * tok_stride +
// (r % per_tok) * n, the first per_tok heads of each token's row of tok_stride values, and the
// weight is the one value `w_all`: Gated DeltaNet's q and k heads, `l2_norm` =
// rms_norm(eps / n) * (1 / sqrt(n)) (src/backend/cpu/ops.rs).

struct Params {
    n: u32,
    n_rows: u32,
    x_off: u32,
    y_off: u32,
    eps: f32,
    zero: u32,
    tok_stride: u32,
    per_tok: u32,
    w_all: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> X: array<f32>;
@group(0) @binding(1) var<storage, read> Wt: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

var<workgroup> partial: array<vec2<f32>, 64>;

// 1 / rms of row x (all 64 threads call it; the result is the same for each).
fn row_scale(x: u32, lid: u32) -> f32 {
    var acc = vec2<f32>(0.0, 0.0);
    for (var i = lid; i < P.n; i += 64u) {
        let v = X[x + i];
        acc = df_add_f(acc, keep(v * v));
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (lid < s) { partial[lid] = df_add(partial[lid], partial[lid + s]); }
        workgroupBarrier();
    }
    let mean = df_div_f32(partial[0], f32(P.n));
    let scale = div_rn(1.0, sqrt_rn(keep(mean + P.eps)));
    workgroupBarrier();
    return scale;
}

fn row_start(r: u32) -> u32 {
    if (P.per_tok == 0u) { return P.x_off + r * P.n; }
    return P.x_off + (r / P.per_tok) * P.tok_stride + (r % P.per_tok) * P.n;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = P.x_off + wid.x * P.n;
    let scale = row_scale(x, lid);
    let y = P.y_off + wid.x * P.n;
    for (var i = lid; i < P.n; i += 64u) {
        Y[y + i] = keep(X[x + i] * scale) * Wt[i];
    }
}

// In place (Q/K norms): X is read and overwritten.
@compute @workgroup_size(64)
fn inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = row_start(wid.x);
    let scale = row_scale(x, lid);
    for (var i = lid; i < P.n; i += 64u) {
        var w = P.w_all;
        if (P.per_tok == 0u) { w = Wt[i]; }
        X[x + i] = keep(X[x + i] * scale) * w;
    }
}
