// Quantized matrix x activation product: Y[t][r] = dot(W row r, A row t).
//
// W holds GGML blocks as stored in the GGUF (`block_q4_0` ... `block_q6_K`, ggml-common.h); A holds
// the activation rows already converted to the weight type's vec_dot_type (Q8_0, Q8_1, Q8_K, F16,
// BF16 or F32; see act_quant.wgsl), byte for byte as ggml's CPU backend makes them. Each block's
// contribution is computed exactly as `ggml_vec_dot_*_generic` (ggml/src/ggml-cpu/quants.c) does:
// an exact i32 sum per block scaled in f32. Only the order in which block contributions are summed
// differs from the CPU (64 strided partial sums, then a tree). The Rust side appends
// `fn block_dot(w: u32, a: u32) -> f32` for the weight type (the files in shaders/quant/) and the
// constants WB (weight block bytes) and AB (activation block bytes). Blocks are read as 32-bit
// words (a funnel shift where a block is not 4-byte aligned) and multiplied four int8 lanes at a
// time with dot4I8Packed; the integer sums are exact, so the order inside a block does not matter.
//
// Threads: `tpr` threads per row (a power of two, 1..64, about the number of blocks per row), so
// a 64-thread workgroup covers 64 / tpr rows. The entry point (and its reduction of the per-thread
// partial sums) comes from matvec_tree.wgsl, or matvec_subgroup.wgsl on adapters with subgroups.

struct Params {
    rows: u32,
    n_blocks: u32,
    w_row_bytes: u32,
    a_row_bytes: u32,
    w_off: u32,
    a_off: u32,
    y_off: u32,
    y_stride: u32,
    grid_x: u32,
    n_tok: u32,
    tpr: u32,
    zero: u32,
    // 1: the `mul_mat_id` form (ggml-cpu `ggml_compute_forward_mul_mat_id`): grid z runs over a
    // list of (slot byte offset, row) pairs in IDS, one expert each; its weights start at
    // w_off + IDS[2z] and its activation and output rows are IDS[2z + 1] (a_row_bytes 0: one
    // activation row for all, a decode token's FFN input).
    ids: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> A: array<u32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;
@group(0) @binding(4) var<storage, read> IDS: array<u32>;

// Where grid slice t's weights start, and its activation / output row.
fn w_base(t: u32) -> u32 {
    if (P.ids == 0u) { return P.w_off; }
    return P.w_off + IDS[2u * t];
}
fn t_row(t: u32) -> u32 {
    if (P.ids == 0u) { return t; }
    return IDS[2u * t + 1u];
}

fn wb(o: u32) -> u32 { return (W[o >> 2u] >> ((o & 3u) << 3u)) & 0xffu; }
fn wi8(o: u32) -> i32 { return (i32(wb(o)) << 24u) >> 24u; }
fn wu16(o: u32) -> u32 { return wb(o) | (wb(o + 1u) << 8u); }
fn wf16(o: u32) -> f32 { return f16_bits_to_f32(wu16(o)); }
fn wu32(o: u32) -> u32 { return wu16(o) | (wu16(o + 2u) << 16u); }
// The 32-bit little-endian word at any byte offset.
fn ww(o: u32) -> u32 {
    let i = o >> 2u;
    let s = (o & 3u) << 3u;
    if (s == 0u) { return W[i]; }
    return (W[i] >> s) | (W[i + 1u] << (32u - s));
}
fn aw(o: u32) -> u32 {
    let i = o >> 2u;
    let s = (o & 3u) << 3u;
    if (s == 0u) { return A[i]; }
    return (A[i] >> s) | (A[i + 1u] << (32u - s));
}
// Sum of the four int8 lanes of a word.
fn lanesum(x: u32) -> i32 { return dot4I8Packed(x, 0x01010101u); }
fn ab(o: u32) -> u32 { return (A[o >> 2u] >> ((o & 3u) << 3u)) & 0xffu; }
fn ai8(o: u32) -> i32 { return (i32(ab(o)) << 24u) >> 24u; }
fn au16(o: u32) -> u32 { return ab(o) | (ab(o + 1u) << 8u); }
fn ai16(o: u32) -> i32 { return (i32(au16(o)) << 16u) >> 16u; }
fn af16(o: u32) -> f32 { return f16_bits_to_f32(au16(o)); }
fn af32(o: u32) -> f32 { return bitcast<f32>(au16(o) | (au16(o + 2u) << 16u)); }
