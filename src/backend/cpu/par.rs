//! Data parallelism: rayon natively, sequential on wasm32 (no threads without atomics).

/// Split `y` into chunks of `chunk` elements and run `f(chunk_index, chunk)` on each, in parallel
/// where threads exist.
pub fn for_each_chunk<T: Send, F>(y: &mut [T], chunk: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Send + Sync,
{
    let chunk = chunk.max(1);
    #[cfg(not(target_arch = "wasm32"))]
    {
        use rayon::prelude::*;
        y.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
    }
    #[cfg(target_arch = "wasm32")]
    {
        y.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// Number of worker threads used for parallel ops.
pub fn n_threads() -> usize {
    #[cfg(not(target_arch = "wasm32"))]
    {
        rayon::current_num_threads()
    }
    #[cfg(target_arch = "wasm32")]
    {
        1
    }
}

/// Set the global thread count (native only; call once before any work).
pub fn init_threads(n: usize) {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global();
    }
    #[cfg(target_arch = "wasm32")]
    let _ = n;
}
