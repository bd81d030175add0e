//! Fuzz the GGUF reader: any bytes must parse or give a typed error, never panic, hang or
//! allocate more than the input allows. Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run gguf_reader`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let src = les::store::MemSource::new(data.to_vec());
    if let Ok(g) = les::gguf::GgufFile::read(&src) {
        // Exercise the accessors the loader uses.
        let _ = les::model::Config::from_gguf(&g);
        for t in &g.tensors {
            let _ = (t.n_elements(), t.row_bytes());
        }
    }
});
