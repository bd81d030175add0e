// Causal attention of one (token, head) per workgroup over an f16 KV cache, as the CPU backend's
// `attend_head` (llama.cpp's CPU flash-attention path, ggml-cpu/ops.cpp
// `ggml_compute_forward_flash_attn_ext_f16`): q rounded to f16, s = (q . k) * scale, online
// softmax, V accumulated in f16 (VKQ16) with fma, output acc / sum.
//
// KV layout (u32 = two f16): K[((layer * n_head_kv + kvh) * n_ctx + pos) * head_dim / 2 + p].
// `kv_store` writes rows of n_head_kv * head_dim f32 values at positions pos0 + t.

struct Params {
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    n_ctx: u32,
    layer: u32,
    pos0: u32,
    n_tok: u32,
    scale: f32,
    q_off: u32,
    o_off: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> K: array<u32>;
@group(0) @binding(2) var<storage, read> V: array<u32>;
@group(0) @binding(3) var<storage, read_write> O: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let h = wid.y;
    let kvh = h / (P.n_head / P.n_head_kv);
    let hp = P.head_dim / 2u;
    let n_kv = P.pos0 + t + 1u;
    let qb = P.q_off + (t * P.n_head + h) * P.head_dim;
    let kvb = (P.layer * P.n_head_kv + kvh) * P.n_ctx * hp;
    // Each thread owns pairs p = lid, lid + 64, ... (head_dim <= 512).
    var acc: array<vec2<f32>, 4>;
    var qv: array<vec2<f32>, 4>;
    for (var i = 0u; i < 4u; i++) {
        acc[i] = vec2<f32>(0.0);
        let p = lid + 64u * i;
        if (p < hp) {
            qv[i] = vec2<f32>(f16_round(Q[qb + 2u * p]), f16_round(Q[qb + 2u * p + 1u]));
        }
    }
    var m = -3.4028235e38;
    var first = true;
    var s_sum = 0.0;
    for (var j = 0u; j < n_kv; j++) {
        var d = 0.0;
        for (var i = 0u; i < 4u; i++) {
            let p = lid + 64u * i;
            if (p < hp) {
                let k = unpack2x16float(K[kvb + j * hp + p]);
                d = fma(k.x, qv[i].x, d);
                d = fma(k.y, qv[i].y, d);
            }
        }
        partial[lid] = d;
        workgroupBarrier();
        for (var s = 32u; s > 0u; s = s >> 1u) {
            if (lid < s) { partial[lid] += partial[lid + s]; }
            workgroupBarrier();
        }
        let sc = partial[0] * P.scale;
        workgroupBarrier();
        var ms = 1.0;
        var vs = 1.0;
        if (first || sc > m) {
            if (!first) { ms = exp(m - sc); } else { ms = 0.0; }
            m = sc;
            first = false;
            for (var i = 0u; i < 4u; i++) {
                acc[i] = vec2<f32>(f16_round(acc[i].x * ms), f16_round(acc[i].y * ms));
            }
        } else {
            vs = exp(sc - m);
        }
        for (var i = 0u; i < 4u; i++) {
            let p = lid + 64u * i;
            if (p < hp) {
                let v = unpack2x16float(V[kvb + j * hp + p]);
                acc[i] = vec2<f32>(f16_round(fma(v.x, vs, acc[i].x)), f16_round(fma(v.y, vs, acc[i].y)));
            }
        }
        s_sum = fma(s_sum, ms, vs);
    }
    var inv = 0.0;
    if (s_sum != 0.0) { inv = 1.0 / s_sum; }
    let ob = P.o_off + (t * P.n_head + h) * P.head_dim;
    for (var i = 0u; i < 4u; i++) {
        let p = lid + 64u * i;
        if (p < hp) {
            O[ob + 2u * p] = acc[i].x * inv;
            O[ob + 2u * p + 1u] = acc[i].y * inv;
        }
    }
}
