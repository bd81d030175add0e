// Rotary position embedding in place on rows of n_head heads x head_dim (llama.cpp `ggml_rope_ext`,
// modes NORM = 0: pairs (2i, 2i+1); NEOX = 2: pairs (i, i + n_rot/2)). The cos/sin table is made on
// the CPU exactly as the CPU backend makes it (theta_i = pos * base^(-2i/n_rot), iterated in f32 as
// ggml does) so both backends rotate by identical values: CS[(t * n_rot/2 + i) * 2 + {0,1}].

struct Params {
    n_head: u32,
    head_dim: u32,
    n_rot: u32,
    neox: u32,
    x_off: u32,
    n_tok: u32,
    zero: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read_write> X: array<f32>;
@group(0) @binding(1) var<storage, read> CS: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let half = P.n_rot / 2u;
    for (var k = lid; k < P.n_head * half; k += 64u) {
        let h = k / half;
        let i = k % half;
        let c = CS[(t * half + i) * 2u];
        let s = CS[(t * half + i) * 2u + 1u];
        let base = P.x_off + (t * P.n_head + h) * P.head_dim;
        var a: u32;
        var b: u32;
        if (P.neox != 0u) { a = base + i; b = base + i + half; } else { a = base + 2u * i; b = base + 2u * i + 1u; }
        let x0 = X[a];
        let x1 = X[b];
        // As the CPU (ops::rope, GCC's contraction of ggml's rotate_pairs): fma(x0, c, -(x1 s)),
        // fma(x0, s, x1 c).
        X[a] = fma_rn(x0, c, -keep(x1 * s));
        X[b] = fma_rn(x0, s, keep(x1 * c));
    }
}
