// Activation rows (f32) -> the weight type's vec_dot_type, byte for byte as ggml's x86 CPU backend
// makes them (ggml/src/ggml-cpu/arch/x86/quants.c `quantize_row_q8_0` / `_q8_1`,
// ggml/src/ggml-quants.c `quantize_row_q8_K_ref`, GGML_FP32_TO_FP16 / _BF16):
//   Q8_0 (34 B / 32): d = f16(amax / 127), q = round_half_even(x * (127 / amax))
//   Q8_1 (36 B / 32): as Q8_0 plus s = f16(d * sum(q))
//   Q8_K (292 B / 256): iscale = -127 / max (max: first element of largest magnitude),
//        q = min(127, round_half_even(x * iscale)), d = 1 / iscale (f32), int16 sums of 16 quants
//   F16 / BF16: round to nearest even.
// WGSL's round() rounds halves to even. Blocks are not 4-byte aligned, so bytes are OR-ed in
// atomically; each row's workgroup first zeroes its own bytes (`clear_row`), so the output needs
// no clear_buffer before the dispatch.

struct Params {
    cols: u32,
    n_tok: u32,
    x_off: u32,
    o_off: u32,
    o_row_bytes: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read_write> O: array<atomic<u32>>;
@group(0) @binding(2) var<uniform> P: Params;

fn put_byte(o: u32, v: u32) {
    atomicOr(&O[o >> 2u], (v & 0xffu) << ((o & 3u) << 3u));
}
fn put_u16(o: u32, v: u32) {
    put_byte(o, v);
    put_byte(o + 1u, v >> 8u);
}
fn put_u32(o: u32, v: u32) {
    put_u16(o, v);
    put_u16(o + 2u, v >> 16u);
}

// Zero row t's bytes [o_off + t * row, + row): whole words, and in a word shared with a
// neighbouring row only this row's bytes (atomicAnd commutes with the neighbour's atomicOr).
// Then a barrier, so no byte of the row is OR-ed in before it is zero.
fn clear_row(t: u32, lid: u32) {
    let start = P.o_off + t * P.o_row_bytes;
    let end = start + P.o_row_bytes;
    for (var w = (start >> 2u) + lid; w < ((end + 3u) >> 2u); w += 64u) {
        let lo = max(start, w * 4u) - w * 4u;
        let hi = min(end, w * 4u + 4u) - w * 4u;
        var m = 0u;
        for (var b = lo; b < hi; b++) { m |= 0xffu << (b * 8u); }
        atomicAnd(&O[w], ~m);
    }
    storageBarrier();
}

// One 32-element Q8 block; returns sum(q). Writes d at o and the quants at qo.
fn q8_block(x: u32, o: u32, qo: u32) -> vec2<f32> {
    var amax = 0.0;
    for (var j = 0u; j < 32u; j++) { amax = max(amax, abs(X[x + j])); }
    let d = amax / 127.0;
    var id = 0.0;
    if (amax != 0.0) { id = 127.0 / amax; }
    var sum = 0;
    for (var j = 0u; j < 32u; j++) {
        let q = clamp(i32(round(X[x + j] * id)), -128, 127);
        sum += q;
        put_byte(qo + j, u32(q));
    }
    put_u16(o, f32_to_f16_bits(d));
    return vec2<f32>(d, f32(sum));
}

@compute @workgroup_size(64)
fn quant_q8_0(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    clear_row(t, lid);
    for (var b = lid; b < P.cols / 32u; b += 64u) {
        let o = P.o_off + t * P.o_row_bytes + b * 34u;
        q8_block(P.x_off + t * P.cols + b * 32u, o, o + 2u);
    }
}

@compute @workgroup_size(64)
fn quant_q8_1(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    clear_row(t, lid);
    for (var b = lid; b < P.cols / 32u; b += 64u) {
        let o = P.o_off + t * P.o_row_bytes + b * 36u;
        let ds = q8_block(P.x_off + t * P.cols + b * 32u, o, o + 4u);
        put_u16(o + 2u, f32_to_f16_bits(ds.y * ds.x));
    }
}

@compute @workgroup_size(64)
fn quant_q8_k(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    clear_row(t, lid);
    for (var b = lid; b < P.cols / 256u; b += 64u) {
        let o = P.o_off + t * P.o_row_bytes + b * 292u;
        let x = P.x_off + t * P.cols + b * 256u;
        var amax = 0.0;
        var mx = 0.0;
        for (var j = 0u; j < 256u; j++) {
            let v = X[x + j];
            if (abs(v) > amax) { amax = abs(v); mx = v; }
        }
        if (amax == 0.0) { continue; }
        let iscale = -127.0 / mx;
        for (var g = 0u; g < 16u; g++) {
            var s = 0;
            for (var j = 0u; j < 16u; j++) {
                let q = min(127, i32(round(iscale * X[x + g * 16u + j])));
                s += q;
                put_byte(o + 4u + g * 16u + j, u32(q));
            }
            put_u16(o + 260u + 2u * g, u32(s));
        }
        put_u32(o, bitcast<u32>(1.0 / iscale));
    }
}

@compute @workgroup_size(64)
fn quant_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    clear_row(t, lid);
    for (var i = lid; i < P.cols; i += 64u) {
        put_u16(P.o_off + t * P.o_row_bytes + 2u * i, f32_to_f16_bits(X[P.x_off + t * P.cols + i]));
    }
}

@compute @workgroup_size(64)
fn quant_bf16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    clear_row(t, lid);
    for (var i = lid; i < P.cols; i += 64u) {
        let u = bitcast<u32>(X[P.x_off + t * P.cols + i]);
        var h: u32;
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            h = (u >> 16u) | 0x40u;
        } else {
            h = (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
        }
        put_u16(P.o_off + t * P.o_row_bytes + 2u * i, h);
    }
}
