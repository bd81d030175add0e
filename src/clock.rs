//! Time for measurements, usable from every layer (backends, experts, engine).

/// Milliseconds from an arbitrary origin (monotonic natively; on wasm32 `performance.now()`,
/// in windows and workers: 5 µs steps on cross-origin isolated pages, 100 µs otherwise, where
/// `Date.now()` counts whole milliseconds).
pub fn now_ms() -> f64 {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::sync::OnceLock;
        use std::time::Instant;
        static T0: OnceLock<Instant> = OnceLock::new();
        T0.get_or_init(Instant::now).elapsed().as_secs_f64() * 1000.0
    }
    #[cfg(target_arch = "wasm32")]
    {
        performance_now()
    }
}

#[cfg(target_arch = "wasm32")]
#[wasm_bindgen::prelude::wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = performance, js_name = now)]
    fn performance_now() -> f64;
}
