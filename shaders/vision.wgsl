// Vision encoder ops (src/vision; the CPU references are in src/backend/cpu/ops.rs and cmath.rs):
//   layer_norm: per row of n values, d = x - mean, y = d * (1 / sqrt(var + eps)) * W (+ B); the
//               CPU sums x and d*d in f64 (ggml's ggml_float): double-f32 sums here (exact.wgsl,
//               64 strided partials then a tree), the same f32 mean and variance except within
//               about 2^-46 of a rounding boundary. One workgroup per row.
//   gelu_tanh:  ggml's table lookup: y = TAB[f16 bits of x] (TAB: the CPU's f16 values of
//               gelu(x) at every f16 x, two per u32), x itself from 10 up, 0 from -10 down.
//   gelu_erf:   y = 0.5 * x * (1 + erff(x / sqrt 2)), erff as cmath::erff (Sun's s_erff.c with
//               glibc's expf), every f32 operation rounded in the CPU's order.
//   place:      Y[r * k + c0 + c] = X[r * n + c] (concatenation of columns, one part at a time).
//   scale:      Y[i] *= s.

struct Params {
    n: u32,      // values per row (place: of the part)
    rows: u32,
    eps: f32,    // layer_norm; scale: the factor
    has_b: u32,  // layer_norm: a bias in B
    k: u32,      // place: columns of Y
    c0: u32,     // place: the part's first column
    zero: u32,   // always 0 (exact.wgsl)
    _p: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> A: array<u32>;   // layer_norm: W's bits; gelu_tanh: TAB
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

var<workgroup> partial: array<vec2<f32>, 64>;

fn row_sum(v: vec2<f32>, lid: u32) -> vec2<f32> {
    partial[lid] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (lid < s) { partial[lid] = df_add(partial[lid], partial[lid + s]); }
        workgroupBarrier();
    }
    let r = partial[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(64)
fn layer_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = wid.x * P.n;
    var acc = vec2<f32>(0.0, 0.0);
    for (var i = lid; i < P.n; i += 64u) { acc = df_add_f(acc, X[x + i]); }
    let mean = div_rn(df_to_f32(row_sum(acc, lid)), f32(P.n));
    var sq = vec2<f32>(0.0, 0.0);
    for (var i = lid; i < P.n; i += 64u) {
        let d = keep(X[x + i] - mean);
        sq = df_add_f(sq, keep(d * d));
    }
    let var_ = df_div_f32(row_sum(sq, lid), f32(P.n));
    let scale = div_rn(1.0, sqrt_rn(keep(var_ + P.eps)));
    for (var i = lid; i < P.n; i += 64u) {
        let d = keep(X[x + i] - mean);
        var y = keep(keep(d * scale) * bitcast<f32>(A[i]));
        if (P.has_b != 0u) { y = keep(y + B[i]); }
        Y[x + i] = y;
    }
}

@compute @workgroup_size(64)
fn gelu_tanh(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let x = Y[i];
    if (x <= -10.0) { Y[i] = 0.0; return; }
    if (x >= 10.0) { return; }
    let h = f32_to_f16_bits(x);
    let w = A[h >> 1u];
    Y[i] = f16_bits_to_f32(select(w & 0xffffu, w >> 16u, (h & 1u) == 1u));
}

// Horner steps of erff, each product and sum rounded (no contraction).
fn hstep(c: f32, s: f32, acc: f32) -> f32 { return keep(c + keep(s * acc)); }

fn erff(x: f32) -> f32 {
    let hx = bitcast<u32>(x);
    let ix = hx & 0x7fffffffu;
    let neg = (hx >> 31u) != 0u;
    if (ix >= 0x7f800000u) {
        if (ix > 0x7f800000u) { return x; }
        return select(1.0, -1.0, neg);
    }
    if (ix < 0x3f580000u) {
        if (ix < 0x31800000u) {
            return keep(0.125 * keep(keep(8.0 * x) + keep(bitcast<f32>(0x3f8375d4u) * x)));
        }
        let z = keep(x * x);
        var r = bitcast<f32>(0xb7c756b1u);
        r = hstep(bitcast<f32>(0xbbbd1489u), z, r);
        r = hstep(bitcast<f32>(0xbce9528fu), z, r);
        r = hstep(bitcast<f32>(0xbea66bebu), z, r);
        r = hstep(bitcast<f32>(0x3e0375d4u), z, r);
        var q = bitcast<f32>(0xb684e21au);
        q = hstep(bitcast<f32>(0x390aee49u), z, q);
        q = hstep(bitcast<f32>(0x3ba68116u), z, q);
        q = hstep(bitcast<f32>(0x3d852a63u), z, q);
        q = hstep(bitcast<f32>(0x3ecbbbceu), z, q);
        let s = keep(1.0 + keep(z * q));
        return keep(x + keep(x * div_rn(r, s)));
    }
    var y: f32;
    if (ix < 0x40c00000u) {
        let a = bitcast<f32>(ix);
        var erfc: f32;
        if (ix < 0x3fa00000u) {
            let s = keep(a - 1.0);
            var p = bitcast<f32>(0xbb0df9c0u);
            p = hstep(bitcast<f32>(0x3d1151b3u), s, p);
            p = hstep(bitcast<f32>(0xbde31cc2u), s, p);
            p = hstep(bitcast<f32>(0x3ea2fe54u), s, p);
            p = hstep(bitcast<f32>(0xbebe9208u), s, p);
            p = hstep(bitcast<f32>(0x3ed46805u), s, p);
            p = hstep(bitcast<f32>(0xbb1acdc6u), s, p);
            var q = bitcast<f32>(0x3c445aa3u);
            q = hstep(bitcast<f32>(0x3c5f6e13u), s, q);
            q = hstep(bitcast<f32>(0x3e013307u), s, q);
            q = hstep(bitcast<f32>(0x3d931ae7u), s, q);
            q = hstep(bitcast<f32>(0x3f0a5785u), s, q);
            q = hstep(bitcast<f32>(0x3dd9f331u), s, q);
            q = keep(1.0 + keep(s * q));
            erfc = keep(keep(1.0 - bitcast<f32>(0x3f58560bu)) - div_rn(p, q));
        } else {
            let s = div_rn(1.0, keep(a * a));
            var r: f32;
            var bs: f32;
            if (ix < 0x4036db6du) {
                r = bitcast<f32>(0xc11d077eu);
                r = hstep(bitcast<f32>(0xc2a2932bu), s, r);
                r = hstep(bitcast<f32>(0xc3389ae7u), s, r);
                r = hstep(bitcast<f32>(0xc322658cu), s, r);
                r = hstep(bitcast<f32>(0xc2798057u), s, r);
                r = hstep(bitcast<f32>(0xc128f022u), s, r);
                r = hstep(bitcast<f32>(0xbf31a0b7u), s, r);
                r = hstep(bitcast<f32>(0xbc21a093u), s, r);
                bs = bitcast<f32>(0xbd777f97u);
                bs = hstep(bitcast<f32>(0x40d23f7cu), s, bs);
                bs = hstep(bitcast<f32>(0x42d9451fu), s, bs);
                bs = hstep(bitcast<f32>(0x43d6810bu), s, bs);
                bs = hstep(bitcast<f32>(0x442158c9u), s, bs);
                bs = hstep(bitcast<f32>(0x43d9486fu), s, bs);
                bs = hstep(bitcast<f32>(0x4309a863u), s, bs);
                bs = hstep(bitcast<f32>(0x419d35ceu), s, bs);
            } else {
                r = bitcast<f32>(0xc3f1c275u);
                r = hstep(bitcast<f32>(0xc480230bu), s, r);
                r = hstep(bitcast<f32>(0xc41f6441u), s, r);
                r = hstep(bitcast<f32>(0xc320a2eau), s, r);
                r = hstep(bitcast<f32>(0xc18e104bu), s, r);
                r = hstep(bitcast<f32>(0xbf4c9dd4u), s, r);
                r = hstep(bitcast<f32>(0xbc21a092u), s, r);
                bs = bitcast<f32>(0xc1b38712u);
                bs = hstep(bitcast<f32>(0x43ed43a7u), s, bs);
                bs = hstep(bitcast<f32>(0x451f90ceu), s, bs);
                bs = hstep(bitcast<f32>(0x4547fdbbu), s, bs);
                bs = hstep(bitcast<f32>(0x44c01759u), s, bs);
                bs = hstep(bitcast<f32>(0x43a2e571u), s, bs);
                bs = hstep(bitcast<f32>(0x41f2b459u), s, bs);
            }
            bs = keep(1.0 + keep(s * bs));
            let z = bitcast<f32>(ix & 0xffffe000u);
            let e1 = expf_glibc(keep(keep(-z * z) - 0.5625));
            let e2 = expf_glibc(keep(keep(keep(z - a) * keep(z + a)) + div_rn(r, bs)));
            erfc = div_rn(keep(e1 * e2), a);
        }
        y = keep(1.0 - erfc);
    } else {
        y = keep(1.0 - bitcast<f32>(0x03800000u));
    }
    return select(y, -y, neg);
}

@compute @workgroup_size(64)
fn gelu_erf(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let x = Y[i];
    Y[i] = keep(keep(0.5 * x) * keep(1.0 + erff(keep(x * 0.70710677))));
}

@compute @workgroup_size(64)
fn place(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    let r = i / P.n;
    let c = i % P.n;
    Y[r * P.k + P.c0 + c] = X[i];
}

@compute @workgroup_size(64)
fn scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= P.n * P.rows) { return; }
    Y[i] = keep(Y[i] * P.eps);
}
