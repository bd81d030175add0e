// f32 <-> f16 conversions done in integer arithmetic (the kernels' f32 path), so results do not
// depend on the driver's rounding mode (WGSL leaves pack2x16float's rounding to the
// implementation). IEEE 754 binary16, round to nearest, ties to even (as `half::f16::from_f32`).
// Adapters with `shader-f16` use f16_native.wgsl instead (same functions, native conversions).

fn f32_to_f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let e = i32((b >> 23u) & 0xffu);
    let m = b & 0x7fffffu;
    if (e == 255) {
        // Inf / NaN (NaN stays quiet).
        return sign | 0x7c00u | select(0u, 0x200u | (m >> 13u), m != 0u);
    }
    let he = e - 127 + 15;
    if (he >= 31) {
        return sign | 0x7c00u;
    }
    if (he <= 0) {
        if (he < -10) {
            return sign;
        }
        let mm = m | 0x800000u;
        let shift = u32(14 - he);
        var r = mm >> shift;
        let rem = mm & ((1u << shift) - 1u);
        let halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (r & 1u) == 1u)) {
            r = r + 1u;
        }
        return sign | r;
    }
    var r = (u32(he) << 10u) | (m >> 13u);
    let rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u) == 1u)) {
        r = r + 1u; // may carry into the exponent, which is the correct rounding
    }
    return sign | r;
}

fn f16_bits_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        // Zero or subnormal: m * 2^-24, exact in f32.
        let v = f32(m) * 5.9604644775390625e-8;
        return select(v, -v, sign != 0u);
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

fn f16_round(x: f32) -> f32 {
    return f16_bits_to_f32(f32_to_f16_bits(x));
}
