//! Data parallelism: rayon natively and in the browser's threaded build (wasm32 with `+atomics`:
//! a pool of web workers started from JS, `wasm-bindgen-rayon`); sequential in the plain wasm32
//! build. Each op is split into the same chunks whatever the thread count, and every chunk is
//! computed the same way on whichever thread, so results never depend on threads.

/// The browser's threaded build: whether JS has started the pool (`initThreadPool`, then
/// [`set_pool_ready`]). Before that, nothing may touch rayon's global pool (it would try to
/// spawn threads the std way, which wasm32 cannot).
#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
static POOL_READY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The threaded build's pool is running (called from JS after `initThreadPool` resolved).
#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
pub fn set_pool_ready() {
    POOL_READY.store(true, std::sync::atomic::Ordering::Release);
}

/// Whether parallel sections go to rayon's pool.
fn parallel() -> bool {
    #[cfg(not(target_arch = "wasm32"))]
    {
        rayon::current_num_threads() > 1
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
    {
        POOL_READY.load(std::sync::atomic::Ordering::Acquire) && rayon::current_num_threads() > 1
    }
    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    {
        false
    }
}

/// Split `y` into chunks of `chunk` elements and run `f(chunk_index, chunk)` on each, in parallel
/// where threads exist.
pub fn for_each_chunk<T: Send, F>(y: &mut [T], chunk: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Send + Sync,
{
    let chunk = chunk.max(1);
    if !parallel() {
        // One thread: run here. Handing each op to the pool's only worker costs two thread
        // wake-ups per op (the caller blocks meanwhile), and after every wait for an expert
        // read the worker has gone to sleep.
        y.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
        return;
    }
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    {
        use rayon::prelude::*;
        y.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// Run `f` on a worker of the thread pool (natively; as is on wasm32). A parallel op started
/// from outside the pool hands its work to the workers and sleeps until they finish: two thread
/// wake-ups per op, hundreds per token. Started on a worker, the op splits its work with the
/// other workers while the caller computes its share. Measured on SmolMoE-32x2, 2 threads,
/// `les run -n 64`: 74-77 → 121-125 tokens/s. Results do not change (each chunk is computed
/// the same way, on whichever thread).
///
/// The browser's threaded build runs `f` where it is: the engine's thread is the one that may
/// call into JS (byte reads), so the forward never moves to a pool worker there.
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    #[cfg(not(target_arch = "wasm32"))]
    {
        if rayon::current_thread_index().is_some() || rayon::current_num_threads() <= 1 {
            f()
        } else {
            rayon::join(f, || ()).0
        }
    }
    #[cfg(target_arch = "wasm32")]
    {
        f()
    }
}

/// Number of worker threads used for parallel ops.
pub fn n_threads() -> usize {
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    {
        if parallel() {
            return rayon::current_num_threads();
        }
    }
    1
}

/// Set the global thread count (natively; call once before any work). The browser's threaded
/// build sizes its pool from JS (`initThreadPool`).
pub fn init_threads(n: usize) {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global();
    }
    #[cfg(target_arch = "wasm32")]
    let _ = n;
}
