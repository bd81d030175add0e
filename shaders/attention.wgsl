// Causal attention over an f16 KV cache, as the CPU backend's `attend_head` (llama.cpp's CPU
// flash-attention path, ggml-cpu/ops.cpp `ggml_compute_forward_flash_attn_ext_f16`), in two passes
// so no pass needs a barrier per key position:
//   scores:    one thread per (token, head, position): s = dot_f16(k, f16(q)) * scale, summed in
//              the CPU's order (4 x 16 fma lanes per 64 values, then the same pairwise tree)
//   factors:   one thread per (token, head): the online softmax's rescale / weight per position
//              (glibc's expf, emulated in exact.wgsl), written over the scores
//   softmax_v: one workgroup per (token, head), threads over pairs of dimensions: V accumulated
//              in f16 (VKQ16) with fma, output acc * (1 / sum).
//
// Sliding window (P.window > 0): query t sees positions n_kv - window .. n_kv only (ggml skips
// masked positions). Blocks (P.block > 0, no causal mask: a vision encoder's self-attention with
// pos0 = 0): query t sees the rows of its block, (t / block) * block .. + block, within n_tok. Attention sinks (P.sinks = 1): one logit per head, SINKS[h], joins the
// softmax's sum after the last position (ggml's flash-attention `sinks`): its factor is the
// extra last score of each row, and a new maximum rescales the accumulator in f32.
//
// KV layout (u32 = two f16): a layer's slot starts at word P.off and holds P.n_ctx cells per KV
// head, position pos in cell pos mod n_ctx (a sliding-window layer's ring: its window and a
// batch fit in the cells; every other slot has a cell per position):
// K[P.off + (kvh * n_ctx + pos mod n_ctx) * head_dim / 2 + p].
// Scores: S[(t * n_head + h) * (n_kv_max + 1) + j] with n_kv_max = pos0 + n_tok (j = n_kv_max:
// the sink's factor).

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    n_ctx: u32,
    off: u32,
    pos0: u32,
    n_tok: u32,
    scale: f32,
    q_off: u32,
    o_off: u32,
    zero: u32,
    _p1: u32,
    window: u32,
    sinks: u32,
    block: u32,
    _p3: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> K: array<u32>;
@group(0) @binding(2) var<storage, read> V: array<u32>;
@group(0) @binding(3) var<storage, read_write> O: array<f32>;
@group(0) @binding(4) var<storage, read_write> S: array<f32>;
@group(0) @binding(5) var<uniform> P: Params;
@group(0) @binding(6) var<storage, read> SINKS: array<f32>;

// The first position query t sees (its sliding window's start).
fn kv_lo(n_kv: u32) -> u32 {
    if (P.window > 0u && n_kv > P.window) { return n_kv - P.window; }
    return 0u;
}

// The positions query t sees: [lo, hi).
fn kv_span(t: u32) -> vec2<u32> {
    if (P.block > 0u) {
        let lo = (t / P.block) * P.block;
        return vec2<u32>(lo, min(lo + P.block, P.n_tok));
    }
    let n_kv = P.pos0 + t + 1u;
    return vec2<u32>(kv_lo(n_kv), n_kv);
}

fn kv_base(h: u32) -> u32 {
    let kvh = h / (P.n_head / P.n_head_kv);
    return P.off + kvh * P.n_ctx * (P.head_dim / 2u);
}

// The first word of position j's row in a head's cells starting at `base`.
fn kv_row(base: u32, j: u32) -> u32 {
    return base + (j % P.n_ctx) * (P.head_dim / 2u);
}

fn k_at(row: u32, d: u32) -> f32 {
    let w = unpack2x16float(K[row + d / 2u]);
    return select(w.x, w.y, (d & 1u) == 1u);
}

@compute @workgroup_size(64)
fn scores(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let n_kv_max = P.pos0 + P.n_tok;
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n_tok * P.n_head * n_kv_max) { return; }
    let j = i % n_kv_max;
    let th = i / n_kv_max;
    let t = th / P.n_head;
    let h = th % P.n_head;
    let span = kv_span(t);
    if (j >= span.y || j < span.x) { return; }
    let row = kv_row(kv_base(h), j);
    let qb = P.q_off + (t * P.n_head + h) * P.head_dim;
    let np = P.head_dim & ~63u;
    var acc: array<f32, 64>;
    for (var l = 0u; l < 64u; l++) { acc[l] = 0.0; }
    for (var c = 0u; c < np; c += 64u) {
        for (var l = 0u; l < 64u; l++) {
            // f16 x f16 is exact in f32, so the CPU's fma is this product then one rounded add.
            acc[l] = keep(acc[l] + keep(k_at(row, c + l) * f16_round(Q[qb + c + l])));
        }
    }
    // acc[16 * r + l] is the CPU's acc[r][l].
    var v: array<f32, 16>;
    for (var l = 0u; l < 16u; l++) { v[l] = keep(keep(acc[l] + acc[32u + l]) + keep(acc[16u + l] + acc[48u + l])); }
    var t3: array<f32, 8>;
    for (var l = 0u; l < 8u; l++) { t3[l] = keep(v[l + 8u] + v[l]); }
    var t6: array<f32, 4>;
    for (var l = 0u; l < 4u; l++) { t6[l] = keep(t3[l + 4u] + t3[l]); }
    // The CPU adds the tail beyond a multiple of 64 in f64 (every product is exact), then rounds
    // to f32: a double-f32 sum here (exact.wgsl).
    var s = vec2<f32>(keep(keep(t6[0] + t6[2]) + keep(t6[1] + t6[3])), 0.0);
    for (var d = np; d < P.head_dim; d++) {
        s = df_add_f(s, keep(k_at(row, d) * f16_round(Q[qb + d])));
    }
    S[th * (n_kv_max + 1u) + j] = df_to_f32(s) * P.scale;
}

// One thread per (token, head): the online softmax's sequence of factors, in the CPU's order
// with glibc's expf (exact.wgsl). Each score S[j] is replaced by its factor: at a new maximum
// the rescale ms = expf(m_old - m) (the first: 0) with the sign bit set as a flag (vs is then 1);
// otherwise vs = expf(s - m) (sign clear).
@compute @workgroup_size(64)
fn factors(@builtin(global_invocation_id) gid: vec3<u32>) {
    let th = gid.x;
    if (th >= P.n_tok * P.n_head) { return; }
    let t = th / P.n_head;
    let n_kv_max = P.pos0 + P.n_tok;
    let span = kv_span(t);
    let sb = th * (n_kv_max + 1u);
    var m = 0.0;
    var first = true;
    for (var j = span.x; j < span.y; j++) {
        let sc = S[sb + j];
        if (first || sc > m) {
            var ms = 0.0;
            if (!first) { ms = expf_glibc(m - sc); }
            m = sc;
            first = false;
            S[sb + j] = bitcast<f32>(bitcast<u32>(ms) | 0x80000000u);
        } else {
            S[sb + j] = expf_glibc(sc - m);
        }
    }
    if (P.sinks != 0u) {
        let sk = SINKS[th % P.n_head];
        if (sk > m) {
            S[sb + n_kv_max] = bitcast<f32>(bitcast<u32>(expf_glibc(m - sk)) | 0x80000000u);
        } else {
            S[sb + n_kv_max] = expf_glibc(sk - m);
        }
    }
}

@compute @workgroup_size(64)
fn softmax_v(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let h = wid.y;
    let hp = P.head_dim / 2u;
    let n_kv_max = P.pos0 + P.n_tok;
    let span = kv_span(t);
    let base = kv_base(h);
    let sb = (t * P.n_head + h) * (n_kv_max + 1u);
    // Each thread owns pairs p = lid, lid + 64, ... (head_dim <= 512).
    var acc: array<vec2<f32>, 4>;
    for (var i = 0u; i < 4u; i++) { acc[i] = vec2<f32>(0.0); }
    var s_sum = 0.0;
    for (var j = span.x; j < span.y; j++) {
        let f = bitcast<u32>(S[sb + j]);
        var ms = 1.0;
        var vs = 1.0;
        if ((f & 0x80000000u) != 0u) {
            ms = bitcast<f32>(f & 0x7fffffffu);
            for (var i = 0u; i < 4u; i++) {
                acc[i] = vec2<f32>(f16_round(acc[i].x * ms), f16_round(acc[i].y * ms));
            }
        } else {
            vs = bitcast<f32>(f);
        }
        for (var i = 0u; i < 4u; i++) {
            let p = lid + 64u * i;
            if (p < hp) {
                let v = unpack2x16float(V[kv_row(base, j) + p]);
                acc[i] = vec2<f32>(f16_round(fma_rn(v.x, vs, acc[i].x)), f16_round(fma_rn(v.y, vs, acc[i].y)));
            }
        }
        s_sum = fma_rn(s_sum, ms, vs);
    }
    // The sink: a new maximum scales the (f32) accumulator by ms; else it adds vs to the sum.
    var acc_ms = 1.0;
    if (P.sinks != 0u) {
        let f = bitcast<u32>(S[sb + n_kv_max]);
        var vs = 1.0;
        var ms = 1.0;
        if ((f & 0x80000000u) != 0u) {
            ms = bitcast<f32>(f & 0x7fffffffu);
            acc_ms = ms;
        } else {
            vs = bitcast<f32>(f);
        }
        s_sum = fma_rn(s_sum, ms, vs);
    }
    var inv = 0.0;
    if (s_sum != 0.0) { inv = div_rn(1.0, s_sum); }
    let ob = P.o_off + (t * P.n_head + h) * P.head_dim;
    for (var i = 0u; i < 4u; i++) {
        let p = lid + 64u * i;
        if (p < hp) {
            O[ob + 2u * p] = keep(acc[i].x * acc_ms) * inv;
            O[ob + 2u * p + 1u] = keep(acc[i].y * acc_ms) * inv;
        }
    }
}
