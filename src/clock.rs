//! Time for measurements, usable from every layer (backends, experts, engine).

/// Milliseconds from an arbitrary origin (monotonic natively; `Date.now()` on wasm32).
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
        js_sys::Date::now()
    }
}
