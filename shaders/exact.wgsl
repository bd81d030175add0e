// Helpers that make a kernel compute the CPU backend's f32 results bit for bit, whatever the
// shader compiler does with plain expressions. Included by kernels whose Params has a `zero`
// field (always 0, but only known at run time).
//
// - keep(x): x unchanged, yet opaque to the compiler. WGSL lets an implementation contract
//   `a * b + c` into an fma and reassociate sums (Mesa fuses such pairs on lavapipe); the CPU
//   reference rounds the product first. keep() around a product or partial sum forbids both.
// - fma_rn: WGSL's fma may round twice (it is unfused on lavapipe); Rust's mul_add rounds once.
//   Dekker's exact product (Veltkamp split) plus a two-sum give the single rounding.
// - div_rn / sqrt_rn: WGSL allows a / b 2.5 ulp from exact and sqrt to inherit 1/inverseSqrt's
//   error; Rust's `/` and `sqrt` round to nearest. Two corrections by the exact residual
//   (Markstein) turn a close quotient or root into the rounded one.
// - Double-f32 ("df", vec2 = hi + lo, about 48 significant bits; Dekker 1971, Knuth TAOCP 4.2.2):
//   enough to emulate the CPU's f64 steps (rms_norm's f64 sum, glibc's double-precision expf)
//   and round the result to f32 exactly as the CPU does, except where the f64 value lies within
//   about 2^-46 (relative) of an f32 rounding boundary.

fn keep(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) ^ P.zero);
}

// Veltkamp's split: a = hi + lo with 12-bit halves, so products of halves are exact.
fn split(a: f32) -> vec2<f32> {
    let t = keep(a * 4097.0);
    let hi = keep(t - keep(t - a));
    return vec2<f32>(hi, keep(a - hi));
}

// a * b = p + e exactly (Dekker's product; WGSL's fma may be unfused: lavapipe's is).
fn two_prod(a: f32, b: f32) -> vec2<f32> {
    let p = keep(a * b);
    let x = split(a);
    let y = split(b);
    let e = keep(keep(keep(keep(keep(x.x * y.x) - p) + keep(x.x * y.y)) + keep(x.y * y.x)) + keep(x.y * y.y));
    return vec2<f32>(p, e);
}

// a + b = s + e exactly (Knuth's two-sum).
fn two_sum(a: f32, b: f32) -> vec2<f32> {
    let s = keep(a + b);
    let bb = keep(s - a);
    let e = keep(keep(a - keep(s - bb)) + keep(b - bb));
    return vec2<f32>(s, e);
}

// |a| >= |b| or a == 0: a + b = s + e exactly.
fn fast_two_sum(a: f32, b: f32) -> vec2<f32> {
    let s = keep(a + b);
    return vec2<f32>(s, keep(b - keep(s - a)));
}

// a * b + c rounded once, as Rust's mul_add (the CPU's fma): the exact product and sum as
// (s, e1) + e0, then one rounding; off only where a * b + c lies within about 2^-24 ulp of a tie.
fn fma_rn(a: f32, b: f32, c: f32) -> f32 {
    if (!(abs(a) < 1e18 && abs(b) < 1e18 && abs(c) < 1e36)) {
        return keep(keep(a * b) + c);
    }
    let p = two_prod(a, b);
    let s = two_sum(p.x, c);
    let r = keep(s.x + keep(s.y + p.y));
    if (r == 0.0) {
        // An exact zero: a * b = -c is representable, and the plain sum has IEEE's sign of zero.
        return keep(keep(a * b) + c);
    }
    return r;
}

// a - q * b exactly, for q close to a / b.
fn residual(a: f32, q: f32, b: f32) -> f32 {
    let p = two_prod(q, b);
    return keep(keep(a - p.x) - p.y);
}

fn div_rn(a: f32, b: f32) -> f32 {
    let q0 = a / b;
    // Zero, huge, tiny or non-finite quotients (and operands) keep the plain result: the
    // residual could overflow or lose bits there; the kernels never depend on those cases.
    if (!(abs(q0) > 1e-30 && abs(q0) < 1e30 && abs(b) > 1e-30 && abs(b) < 1e30 && abs(a) < 1e30)) {
        return q0;
    }
    let y = keep(1.0 / b);
    let q1 = keep(q0 + keep(residual(a, q0, b) * y));
    return keep(q1 + keep(residual(a, q1, b) * y));
}

fn sqrt_rn(x: f32) -> f32 {
    let s = sqrt(x);
    if (!(x > 1e-30 && x < 1e30)) {
        return s;
    }
    let h = keep(0.5 / s);
    let t = keep(s + keep(residual(x, s, s) * h));
    return keep(t + keep(residual(x, t, t) * h));
}

fn df_add(x: vec2<f32>, y: vec2<f32>) -> vec2<f32> {
    let s = two_sum(x.x, y.x);
    let t = two_sum(x.y, y.y);
    var u = fast_two_sum(s.x, keep(s.y + t.x));
    return fast_two_sum(u.x, keep(u.y + t.y));
}

fn df_add_f(x: vec2<f32>, b: f32) -> vec2<f32> {
    let s = two_sum(x.x, b);
    return fast_two_sum(s.x, keep(s.y + x.y));
}

fn df_mul(x: vec2<f32>, y: vec2<f32>) -> vec2<f32> {
    let p = two_prod(x.x, y.x);
    let c = keep(keep(x.x * y.y) + keep(x.y * y.x));
    return fast_two_sum(p.x, keep(p.y + c));
}

// The f32 nearest to x.hi + x.lo (a normalised df is already its own rounding, except at a tie).
fn df_to_f32(x: vec2<f32>) -> f32 {
    return keep(x.x + x.y);
}

// (x.hi + x.lo) / n rounded to f32, n > 0 (the CPU: `(sum / n as f64) as f32`).
fn df_div_f32(x: vec2<f32>, n: f32) -> f32 {
    let q0 = div_rn(x.x, n);
    let r = keep(residual(x.x, q0, n) + x.y);
    return keep(q0 + div_rn(r, n));
}

// glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, FMA build; src/backend/cpu/cmath.rs `expf`)
// evaluated in double-f32 instead of f64: z = x * 32/ln2, k = round(z), r = z - k,
// 2^(k/32) from the 32-entry table, a cubic in r, rounded once to f32.
var<private> EXP2_HI: array<u32, 32> = array<u32, 32>(
    0x3f800000u, 0x3f82cd87u, 0x3f85aac3u, 0x3f88980fu, 0x3f8b95c2u, 0x3f8ea43au, 0x3f91c3d3u, 0x3f94f4f0u,
    0x3f9837f0u, 0x3f9b8d3au, 0x3f9ef532u, 0x3fa27043u, 0x3fa5fed7u, 0x3fa9a15bu, 0x3fad583fu, 0x3fb123f6u,
    0x3fb504f3u, 0x3fb8fbafu, 0x3fbd08a4u, 0x3fc12c4du, 0x3fc5672au, 0x3fc9b9beu, 0x3fce248cu, 0x3fd2a81eu,
    0x3fd744fdu, 0x3fdbfbb8u, 0x3fe0ccdfu, 0x3fe5b907u, 0x3feac0c7u, 0x3fefe4bau, 0x3ff5257du, 0x3ffa83b3u);
var<private> EXP2_LO: array<u32, 32> = array<u32, 32>(
    0x00000000u, 0xb34ea7a9u, 0x334f9891u, 0xb37eda4bu, 0xb260aba1u, 0xb3697465u, 0x33675624u, 0xb32e0212u,
    0x33231b71u, 0xb30c5563u, 0x33412342u, 0x30c3125au, 0xb32c9d5eu, 0xb3162b08u, 0xb22deaf6u, 0xb37c5aa8u,
    0x32cfe77au, 0x330ec5f7u, 0xb3414fe8u, 0xb2d6663eu, 0x320aa837u, 0xb37323a2u, 0x3228fc24u, 0xb35c1daau,
    0xb2d4a58au, 0xb3504a1cu, 0xb21eab59u, 0xb2441be6u, 0xb24116deu, 0xb348464au, 0x32292436u, 0xb2923758u);

fn dfc(hi: u32, lo: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(hi), bitcast<f32>(lo));
}

fn expf_glibc(x: f32) -> f32 {
    // Range limits as glibc: above ln(2^128) overflows, below ln(2^-150) underflows to 0.
    if (x > bitcast<f32>(0x42b17217u)) {
        return bitcast<f32>(0x7f800000u ^ P.zero);
    }
    if (!(x >= bitcast<f32>(0xc2cff1b4u))) {
        return 0.0;
    }
    let z = df_mul(dfc(0x4238aa3bu, 0x35257060u), vec2<f32>(x, 0.0)); // x * 32/ln2
    var k = round(z.x);
    var r = df_add_f(vec2<f32>(keep(z.x - k), 0.0), z.y); // z.x - k is exact
    if (r.x > 0.5) {
        k = k + 1.0;
        r = df_add_f(r, -1.0);
    } else if (r.x < -0.5) {
        k = k - 1.0;
        r = df_add_f(r, 1.0);
    }
    let ki = i32(k);
    let j = u32(ki & 31);
    let e = ki >> 5u;
    let s = dfc(EXP2_HI[j], EXP2_LO[j]);
    let zz = df_add(df_mul(dfc(0x35e357c2u, 0x29391239u), r), dfc(0x3975fe73u, 0xacf053b1u)); // C0 r + C1
    let r2 = df_mul(r, r);
    var y = df_add_f(df_mul(dfc(0x3cb17218u, 0xae73ad2au), r), 1.0); // C2 r + 1
    y = df_add(df_mul(zz, r2), y);
    let v = df_mul(y, s); // 2^(j/32) * poly, in [0.98, 2.03)
    // Times 2^e (e in -150..128) in two power-of-two steps: the first stays normal and exact,
    // the second rounds a subnormal result (once, from h: values below 2^-125 only).
    let e1 = clamp(e, -125, 127);
    let e2 = e - e1;
    let h = df_to_f32(v);
    return keep(h * bitcast<f32>(u32(e1 + 127) << 23u)) * bitcast<f32>(u32(clamp(e2 + 127, 1, 254)) << 23u);
}

var<private> P_INF_BITS: u32 = 0x7f800000u;

// ggml_v_expf / ggml_expf (ggml-cpu/vec.h, scalar form): exact port, so silu matches the CPU bit for bit.
fn ggml_expf(x: f32) -> f32 {
    // ggml adds and subtracts 0x1.8p23 to round x*log2(e) to an integer (the fma rounds the exact
    // product); keep() stops the compiler from folding the pair away.
    let n = keep(fma_rn(x, bitcast<f32>(0x3fb8aa3bu), bitcast<f32>(0x4b400000u))) - bitcast<f32>(0x4b400000u);
    var b = fma_rn(-n, bitcast<f32>(0x3f317200u), x);
    b = fma_rn(-n, bitcast<f32>(0x35bfbe8eu), b);
    if (abs(n) > 192.0) {
        if (n <= 0.0) { return 0.0; }
        // +inf from a runtime value: WGSL rejects a constant expression that evaluates to inf.
        return bitcast<f32>(P_INF_BITS);
    }
    let u = keep(b * b);
    let p = fma_rn(bitcast<f32>(0x3c072010u), b, bitcast<f32>(0x3d2b9f17u));
    let q = fma_rn(bitcast<f32>(0x3e2aaf33u), b, bitcast<f32>(0x3efffedbu));
    let lin = fma_rn(bitcast<f32>(0x3f7ffff6u), b, 1.0);
    let j = fma_rn(fma_rn(p, u, q), u, lin);
    let ni = i32(n);
    let a = ni / 2;
    let c = ni - ni / 2;
    return keep(j * bitcast<f32>(u32(clamp(a + 127, 1, 254)) << 23u)) * bitcast<f32>(u32(clamp(c + 127, 1, 254)) << 23u);
}

// logf as the `libm` crate's `logf` (FreeBSD e_logf.c; src/backend/cpu/ops.rs `softplus`): f32
// arithmetic only, every product and sum kept as Rust rounds it. Normal positive x only
// (softplus takes it of 1 + e^x >= 1).
fn logf_bsd(x_in: f32) -> f32 {
    var ix = bitcast<u32>(x_in);
    if (ix == 0x3f800000u) { return 0.0; }
    ix = ix + (0x3f800000u - 0x3f3504f3u);
    let k = i32(ix >> 23u) - 0x7f;
    ix = (ix & 0x007fffffu) + 0x3f3504f3u;
    let x = bitcast<f32>(ix);
    let f = keep(x - 1.0);
    let s = div_rn(f, keep(2.0 + f));
    let z = keep(s * s);
    let w = keep(z * z);
    let t1 = keep(w * keep(bitcast<f32>(0x3eccce13u) + keep(w * bitcast<f32>(0x3e789e26u))));
    let t2 = keep(z * keep(bitcast<f32>(0x3f2aaaaau) + keep(w * bitcast<f32>(0x3e91e9eeu))));
    let r = keep(t2 + t1);
    let hfsq = keep(keep(0.5 * f) * f);
    let dk = f32(k);
    let a = keep(s * keep(hfsq + r));
    let b = keep(a + keep(dk * bitcast<f32>(0x3717f7d1u)));
    let c = keep(b - hfsq);
    let d = keep(c + f);
    return keep(d + keep(dk * bitcast<f32>(0x3f317180u)));
}
