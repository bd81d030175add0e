enable f16;
// f32 <-> f16 conversions with the hardware's f16 type (adapters with `shader-f16`): the same
// functions as f16_emul.wgsl, a few instructions each instead of ~20 integer operations. Vulkan,
// Metal and D3D12 convert f32 to f16 rounding to nearest even, which is what the CPU does
// (`half::f16::from_f32`); tests/wgpu_kernels.rs checks both variants bit for bit on the
// adapter it runs on (every half, and the kernels that convert).

fn f32_to_f16_bits(x: f32) -> u32 {
    // Beyond f16's range WGSL leaves the conversion undefined; round to nearest gives infinity.
    if (abs(x) >= 65520.0) {
        return select(0x7c00u, 0xfc00u, x < 0.0);
    }
    // f16(x) rounds; packing a value that is already a half is exact whatever pack's rounding.
    return pack2x16float(vec2<f32>(f32(f16(x)), 0.0)) & 0xffffu;
}

fn f16_bits_to_f32(h: u32) -> f32 {
    return unpack2x16float(h).x;
}

fn f16_round(x: f32) -> f32 {
    if (abs(x) >= 65520.0) {
        return f16_bits_to_f32(f32_to_f16_bits(x));
    }
    return f32(f16(x));
}
