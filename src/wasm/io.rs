//! The page's asynchronous reader (`AsyncReads` of `www/les/io.js`) behind
//! [`crate::expert::io::AsyncIo`], the browser's read executor: prefetch pieces are read by the
//! page while the engine computes; demand reads stay synchronous on the engine's thread.
//!
//! `io.js` has two modes:
//! * `shared` (the page is cross-origin isolated): an I/O worker reads pieces from the model's
//!   OPFS file (its own sync access handle) or local `File` into lanes of a `SharedArrayBuffer`
//!   and flags them done with `Atomics`; the engine sees them at its next layer without yielding
//!   and can block on one it needs (`Atomics.wait`). With the threaded build the wasm memory is
//!   itself shared: the worker then reads each piece straight into its expert slot (the address
//!   goes with the read, [`AsyncReader::direct`]) and nothing is copied when it is taken in.
//! * `local` (no isolation): the engine's worker starts `File.slice().arrayBuffer()` reads
//!   itself; they complete whenever the worker awaits (every layer's readback on WebGPU). A piece
//!   the engine needs before it arrives is read synchronously.

use crate::expert::io::AsyncReader;
use wasm_bindgen::prelude::*;

#[wasm_bindgen]
extern "C" {
    /// `AsyncReads` of `www/les/io.js`.
    pub type AsyncReads;
    /// `ranges`: [offset, length, offset, length, ...]; `dest`: the wasm address a direct read
    /// fills, else -1.
    #[wasm_bindgen(method, catch)]
    fn submit(this: &AsyncReads, id: u32, ranges: &[f64], dest: f64) -> Result<bool, JsValue>;
    /// Reads go straight into the engine's (shared) wasm memory.
    #[wasm_bindgen(method, getter)]
    fn direct(this: &AsyncReads) -> bool;
    #[wasm_bindgen(method)]
    fn poll(this: &AsyncReads) -> Vec<u32>;
    #[wasm_bindgen(method, catch)]
    fn take(this: &AsyncReads, id: u32, dest: &js_sys::Uint8Array) -> Result<(), JsValue>;
    #[wasm_bindgen(method)]
    fn wait(this: &AsyncReads, id: u32) -> bool;
    #[wasm_bindgen(method)]
    fn cancel(this: &AsyncReads, id: u32);
    #[wasm_bindgen(method, getter)]
    fn mode(this: &AsyncReads) -> String;
    #[wasm_bindgen(method, getter, js_name = maxPiece)]
    fn max_piece(this: &AsyncReads) -> f64;
}

/// [`AsyncReads`] as an [`AsyncReader`]; the flag: its reads are direct (asked once).
pub struct JsReads(AsyncReads, bool);

impl JsReads {
    pub fn new(r: AsyncReads) -> Self {
        let direct = r.direct();
        Self(r, direct)
    }
}

// Only the engine's thread uses it (the threaded build's pool runs CPU kernels only).
unsafe impl Send for JsReads {}
unsafe impl Sync for JsReads {}

impl AsyncReader for JsReads {
    fn submit(&self, id: u32, ranges: &[(u64, usize)], dest: Option<*mut u8>) -> bool {
        let flat: Vec<f64> = ranges.iter().flat_map(|&(o, l)| [o as f64, l as f64]).collect();
        // A wasm32 address is the pointer's value.
        let dest = dest.map_or(-1.0, |p| p as usize as f64);
        self.0.submit(id, &flat, dest).unwrap_or(false)
    }
    fn direct(&self) -> bool {
        self.1
    }
    fn poll(&self) -> Vec<u32> {
        self.0.poll()
    }
    fn take(&self, id: u32, dest: &mut [u8]) -> Result<(), String> {
        // SAFETY: `dest` lives in wasm memory and nothing allocates while JS copies into it (a
        // direct read is already there: JS checks that `dest` is where it went).
        let view = unsafe { js_sys::Uint8Array::view_mut_raw(dest.as_mut_ptr(), dest.len()) };
        self.0.take(id, &view).map_err(|e| super::js_error_text(&e))
    }
    fn wait(&self, id: u32) -> bool {
        self.0.wait(id)
    }
    fn cancel(&self, id: u32) {
        self.0.cancel(id)
    }
    fn max_piece(&self) -> usize {
        self.0.max_piece() as usize
    }
    fn describe(&self) -> String {
        if self.1 {
            format!("{}, into the slots", self.0.mode())
        } else {
            self.0.mode()
        }
    }
}
