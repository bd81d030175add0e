// Shared helpers for LES kernels. Every kernel is also given the f16 conversions
// (f32_to_f16_bits, f16_bits_to_f32, f16_round) from f16_emul.wgsl or, on adapters with
// `shader-f16`, f16_native.wgsl.

fn bf16_bits_to_f32(h: u32) -> f32 {
    return bitcast<f32>(h << 16u);
}
