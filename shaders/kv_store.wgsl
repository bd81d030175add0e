// Store the rotated K and the V rows of a batch into the f16 KV cache (round to nearest even,
// as the CPU's `KvCache::store`). Layout as in attention.wgsl: position pos0 + t goes to cell
// (pos0 + t) mod n_ctx of the slot at word `off`.

struct Params {
    n_head_kv: u32,
    head_dim: u32,
    n_ctx: u32,
    off: u32,
    pos0: u32,
    n_tok: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> Kin: array<f32>;
@group(0) @binding(1) var<storage, read> Vin: array<f32>;
@group(0) @binding(2) var<storage, read_write> K: array<u32>;
@group(0) @binding(3) var<storage, read_write> V: array<u32>;
@group(0) @binding(4) var<uniform> P: Params;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let hp = P.head_dim / 2u;
    for (var k = lid; k < P.n_head_kv * hp; k += 64u) {
        let h = k / hp;
        let p = k % hp;
        let src = t * P.n_head_kv * P.head_dim + h * P.head_dim + 2u * p;
        let dst = P.off + (h * P.n_ctx + (P.pos0 + t) % P.n_ctx) * hp + p;
        K[dst] = f32_to_f16_bits(Kin[src]) | (f32_to_f16_bits(Kin[src + 1u]) << 16u);
        V[dst] = f32_to_f16_bits(Vin[src]) | (f32_to_f16_bits(Vin[src + 1u]) << 16u);
    }
}
