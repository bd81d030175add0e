//! Native read throughput of LES's file source (`FileSource::read_at`, pread) for a list of
//! (offset) reads of BLOCK bytes: the native side of the OPFS comparison in tests/e2e/bench.mjs.
//! Usage: read_bench FILE BLOCK OFFSETS_FILE [cold] (one offset per line); prints MB/s (after a
//! warm-up of the first 50 reads unless `cold`).
use les::store::{ByteSource, FileSource};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let src = FileSource::open(&a[1]).expect("open");
    let block: usize = a[2].parse().expect("block");
    let offs: Vec<u64> = std::fs::read_to_string(&a[3]).expect("offsets").lines().map(|l| l.parse().expect("offset")).collect();
    let mut buf = vec![0u8; block];
    let warm = if a.get(4).map(String::as_str) == Some("cold") { 0 } else { 50 };
    for &o in offs.iter().take(warm) {
        src.read_at(o, &mut buf).expect("read");
    }
    let t0 = std::time::Instant::now();
    for &o in &offs {
        src.read_at(o, &mut buf).expect("read");
    }
    let s = t0.elapsed().as_secs_f64();
    println!("{:.0}", offs.len() as f64 * block as f64 / 1e6 / s);
}
