// Gated DeltaNet kernels (qwen35moe / qwen3next), each the CPU reference's operations in its
// order (src/backend/cpu/ops.rs; exact.wgsl keeps every rounding):
//   conv_silu: one thread per channel, tokens in order: y = silu(sum_k state[k] * w[k] + x * w[K-1])
//              (`conv_silu_step`: each term a fused multiply-add, as ggml's `ssm_conv` compiles on
//              FMA machines; silu with ggml_expf, or none for lfm2's short conv), then the
//              channel's state shifts by one.
//   delta_net: one workgroup per value head, tokens in order. q and k arrive L2-normalised
//              (`l2_norm`, made in place by rms_norm.wgsl with eps / S and the weight
//              1 / sqrt(S): the same roundings); each thread makes the head's decay
//              g = softplus(alpha + dt_bias) * ssm_a and beta = sigmoid(b) (no thread-0 branch:
//              Chromium's SwiftShader took minutes to compile one and lost the device), copies
//              a share of q, k into workgroup memory, then owns rows j of the S x S state
//              (`delta_rule_step`): M_j *= e^g; d = (v_j - M_j . k) * beta; M_j += d k (fma);
//              o_j = (M_j . q) / sqrt(S), dots in the CPU's portable eight-accumulator order.
// Bindings: X input rows, A (conv weights | alpha rows), B (beta rows), V1 (dt_bias), V2 (ssm_a),
// S the layer's state, Y output rows.

struct Params {
    n_tok: u32,
    cols: u32,   // conv: channels; delta_net: conv-output columns (2 H_k S + H_v S)
    d_conv: u32,
    hk: u32,     // conv: 1 = SiLU after the sum (Gated DeltaNet), 0 = none (lfm2's short conv)
    hv: u32,
    s: u32,
    tiled: u32,
    eps: f32,
    zero: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read> V1: array<f32>;
@group(0) @binding(4) var<storage, read> V2: array<f32>;
@group(0) @binding(5) var<storage, read_write> S: array<f32>;
@group(0) @binding(6) var<storage, read_write> Y: array<f32>;
@group(0) @binding(7) var<uniform> P: Params;

@compute @workgroup_size(64)
fn conv_silu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let c = gid.x + gid.y * nw.x * 64u;
    if (c >= P.cols) { return; }
    let kc = P.d_conv - 1u;
    let st = c * kc;
    let w = c * P.d_conv;
    for (var t = 0u; t < P.n_tok; t++) {
        let x = X[t * P.cols + c];
        var sum = 0.0;
        for (var k = 0u; k < kc; k++) {
            sum = fma_rn(S[st + k], A[w + k], sum);
        }
        sum = fma_rn(x, A[w + kc], sum);
        if (P.hk != 0u) {
            Y[t * P.cols + c] = div_rn(sum, keep(1.0 + ggml_expf(-sum)));
        } else {
            Y[t * P.cols + c] = sum;
        }
        for (var k = 0u; k + 1u < kc; k++) {
            S[st + k] = S[st + k + 1u];
        }
        S[st + kc - 1u] = x;
    }
}

var<workgroup> QK: array<f32, 2048>; // q then k of the head's key head, S <= 1024 each

// Row j of the state (at `m`) dotted with QK[off..off+S], float.rs `dot_generic` order.
fn dot_row(m: u32, off: u32) -> f32 {
    let n8 = P.s & ~7u;
    var acc: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) { acc[k] = 0.0; }
    for (var i = 0u; i < n8; i += 8u) {
        for (var k = 0u; k < 8u; k++) {
            acc[k] = keep(acc[k] + keep(S[m + i + k] * QK[off + i + k]));
        }
    }
    var sum = keep(keep(keep(acc[0] + acc[4]) + keep(acc[1] + acc[5])) + keep(keep(acc[2] + acc[6]) + keep(acc[3] + acc[7])));
    for (var i = n8; i < P.s; i++) {
        sum = keep(sum + keep(S[m + i] * QK[off + i]));
    }
    return sum;
}

@compute @workgroup_size(64)
fn delta_net(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let s = P.s;
    var kh = h / (P.hv / P.hk);
    if (P.tiled != 0u) { kh = h % P.hk; }
    let sf = f32(s);
    let out_scale = div_rn(1.0, sqrt_rn(sf));
    for (var t = 0u; t < P.n_tok; t++) {
        let row = t * P.cols;
        let qb = row + kh * s;
        let kb = row + (P.hk + kh) * s;
        // Every thread makes the head's decay and beta (the same values; no branch on the
        // thread, which SwiftShader compiles far more slowly) and a share of q, k.
        var a = keep(A[t * P.hv + h] + V1[h]);
        if (!(a > 20.0)) {
            a = logf_bsd(keep(1.0 + expf_glibc(a)));
        }
        let g = keep(a * V2[h]);
        let beta = div_rn(1.0, keep(1.0 + expf_glibc(-B[t * P.hv + h])));
        for (var i = lid; i < s; i += 64u) {
            QK[i] = X[qb + i];
            QK[s + i] = X[kb + i];
        }
        workgroupBarrier();
        let decay = expf_glibc(g);
        // One state row per thread: a row evolves on its own (it meets only v[j] and its own
        // d[j]), so the rows of a head split across workgroups (y: blocks of 64 rows).
        let j = wid.y * 64u + lid;
        if (j < s) {
            let m = (h * s + j) * s;
            for (var i = 0u; i < s; i++) {
                S[m + i] = keep(S[m + i] * decay);
            }
            let d = keep(keep(X[row + (2u * P.hk + h) * s + j] - dot_row(m, s)) * beta);
            for (var i = 0u; i < s; i++) {
                S[m + i] = fma_rn(QK[s + i], d, S[m + i]);
            }
            Y[t * P.hv * s + h * s + j] = keep(dot_row(m, 0u) * out_scale);
        }
        workgroupBarrier();
    }
}
