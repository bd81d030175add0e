use les::gguf::GgufFile;
use les::quant::{self, GgmlType, Simd};
use les::store::{ByteSource, FileSource};
fn main() {
    let src = FileSource::open("models/rand-llama-moe.gguf").unwrap();
    let g = GgufFile::read(&src).unwrap();
    let t = g.tensor("blk.2.attn_output.weight").unwrap();
    let w = src.read_vec(t.offset, t.size as usize).unwrap();
    let x: Vec<f32> = std::fs::read("/tmp/dump_ref2/0/kqv_out-2#0.f32".replace("/0/", &format!("/{}/", std::env::var("STEP").unwrap_or("0".into())))).unwrap().chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let r: Vec<f32> = std::fs::read("/tmp/dump_ref2/0/attn_out-2#0.f32".replace("/0/", &format!("/{}/", std::env::var("STEP").unwrap_or("0".into())))).unwrap().chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let n = 256; let rb = GgmlType::Q6K.row_bytes(n as u64).unwrap() as usize;
    for (name, qref) in [("x86", false), ("ref", true)] {
        let mut bad = [0; 2];
        for tok in 0..x.len() / n {
            let mut a = Vec::new();
            if qref { quant::quantize_activation_reference(GgmlType::Q8K, &x[tok*n..(tok+1)*n], &mut a).unwrap(); } else { quant::quantize_activation(GgmlType::Q8K, &x[tok*n..(tok+1)*n], &mut a).unwrap(); }
            for row in 0..256 {
                for (si, simd) in [Simd::Avx2, Simd::Scalar].iter().enumerate() {
                    let d = quant::vec_dot_with(*simd, GgmlType::Q6K, n, &w[row*rb..(row+1)*rb], &a);
                    if d.to_bits() != r[tok*256+row].to_bits() { bad[si] += 1; }
                }
            }
        }
        println!("{name} quantizer: mismatches avx2 {} scalar {}", bad[0], bad[1]);
    }
    // generic ggml formula variants
    let mut bad = [0; 4];
    for tok in 0..x.len() / n {
        let mut a = Vec::new();
        quant::quantize_activation(GgmlType::Q8K, &x[tok*n..(tok+1)*n], &mut a).unwrap();
        let ad = f32::from_le_bytes(a[0..4].try_into().unwrap());
        let q8: Vec<i32> = a[4..260].iter().map(|&b| b as i8 as i32).collect();
        for row in 0..256 {
            let b = &w[row*rb..(row+1)*rb];
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = half::f16::from_bits(u16::from_le_bytes([b[208], b[209]])).to_f32();
            let mut q = [0i32; 256];
            for h in 0..2 { for l in 0..32 {
                let (ql, qh) = (&ql[64*h..], &qh[32*h..]);
                q[128*h + l] = ((ql[l] & 0xf) as i32 | (((qh[l] >> 0) & 3) as i32) << 4) - 32;
                q[128*h + l + 32] = ((ql[l+32] & 0xf) as i32 | (((qh[l] >> 2) & 3) as i32) << 4) - 32;
                q[128*h + l + 64] = ((ql[l] >> 4) as i32 | (((qh[l] >> 4) & 3) as i32) << 4) - 32;
                q[128*h + l + 96] = ((ql[l+32] >> 4) as i32 | (((qh[l] >> 6) & 3) as i32) << 4) - 32;
            }}
            let mut aux = [0i32; 8];
            for j in 0..16 { let s = sc[j] as i8 as i32; for l in 0..8 { aux[l] += s * q[16*j+l] * q8[16*j+l]; aux[l] += s * q[16*j+8+l] * q8[16*j+8+l]; } }
            let dd = d * ad;
            let want = r[tok*256+row].to_bits();
            // v0: sums unfused, sequential
            let mut s0 = 0f32; for l in 0..8 { s0 += dd * aux[l] as f32; }
            let mut s1 = 0f32; for l in 0..8 { s1 = dd.mul_add(aux[l] as f32, s1); }
            // v2: sums[l] = dd*aux (fused into 0 = plain product), then sum with fma? plain sum
            let sums: Vec<f32> = (0..8).map(|l| dd * aux[l] as f32).collect();
            let mut s2 = 0f32; for l in 0..8 { s2 += sums[l]; }
            // v3: tree
            let s3 = ((sums[0]+sums[4]) + (sums[2]+sums[6])) + ((sums[1]+sums[5]) + (sums[3]+sums[7]));
            let tot: i32 = aux.iter().sum();
            let s2 = ((tot as f32) * d) * ad;
            let s3 = (tot as f32 * d).mul_add(ad, 0.0);
            for (i, v) in [s0, s1, s2, s3].iter().enumerate() { if v.to_bits() != want { bad[i] += 1; } }
            if tok == 0 && row < 6 {
                let tot: i64 = aux.iter().map(|&v| v as i64).sum();
                let avx = quant::vec_dot_with(Simd::Avx2, GgmlType::Q6K, n, b, &a);
                println!("row {row}: ref {:e} avx {:e} exact {:e} d {:e} ad {:e} isum {tot} implied ad {:e}", r[tok*256+row], avx, dd as f64 * tot as f64, d, ad, r[tok*256+row] as f64 / (d as f64 * tot as f64));
            }
        }
    }
    println!("generic variants mismatches {:?}", bad);
}
