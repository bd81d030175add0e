//! An emergency reserve of memory, so that an allocation the heap refuses shrinks the budget
//! instead of ending the session (issue 39: a browser tab or a phone takes memory back).
//!
//! Buffers that LES sizes from its budget (expert slots, KV cache, dense reads) already fail as
//! typed errors or shrink the cache (`try_reserve`). The activations of a forward are ordinary
//! `Vec`s: where the heap is at its limit (the browser's wasm memory, which grows only while the
//! browser allows it) their allocation would abort. [`Reserve`] wraps the global allocator: it
//! holds one block (the reserve, [`set_reserve`]); when an allocation fails, it frees the reserve
//! and tries once more, so the forward goes on, and counts a release. Before its next forward the
//! session sees the release ([`take_releases`]), lowers its budget by an eighth (never below the
//! minimum: the expert cache gives back slots) and takes a new reserve. Only an allocation larger
//! than the reserve and all free memory still aborts.
//!
//! The wasm build installs it as its global allocator; a native program may (`les` does), and
//! a test binary wraps its own limited allocator with it.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::Relaxed};

static RESERVE: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static RESERVE_LEN: AtomicUsize = AtomicUsize::new(0);
/// Releases not yet handled by a session, and all releases so far.
static PENDING: AtomicUsize = AtomicUsize::new(0);
static RELEASES: AtomicUsize = AtomicUsize::new(0);
/// A [`Reserve`] is the global allocator (so a reserve can be given back).
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Alignment of the reserve block.
const ALIGN: usize = 64;

/// A global allocator that gives back the reserve when `A` refuses an allocation, then retries.
pub struct Reserve<A>(pub A);

impl<A: GlobalAlloc> Reserve<A> {
    fn noted(&self) {
        if !INSTALLED.load(Relaxed) {
            INSTALLED.store(true, Relaxed);
        }
    }
    /// Free the reserve (through `A`, which allocated it); false when there was none.
    fn release(&self) -> bool {
        let p = RESERVE.swap(std::ptr::null_mut(), Relaxed);
        if p.is_null() {
            return false;
        }
        let len = RESERVE_LEN.swap(0, Relaxed);
        // SAFETY: `p` was allocated by `set_reserve` through the global allocator (this one, so
        // through `A`) with this layout, and the swap above hands it to one caller only.
        unsafe { self.0.dealloc(p, Layout::from_size_align_unchecked(len, ALIGN)) };
        PENDING.fetch_add(1, Relaxed);
        RELEASES.fetch_add(1, Relaxed);
        true
    }
}

// SAFETY: every call forwards to `A`; a null result is retried once after the reserve (a block
// `A` allocated) is freed.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Reserve<A> {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        self.noted();
        let p = unsafe { self.0.alloc(l) };
        if p.is_null() && self.release() {
            return unsafe { self.0.alloc(l) };
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(l) };
        if p.is_null() && self.release() {
            return unsafe { self.0.alloc_zeroed(l) };
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { self.0.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { self.0.realloc(p, l, new_size) };
        if q.is_null() && self.release() {
            return unsafe { self.0.realloc(p, l, new_size) };
        }
        q
    }
}

/// Hold a reserve of `bytes` (when none is held and a [`Reserve`] is the global allocator).
/// Returns whether a reserve is held now.
pub fn set_reserve(bytes: usize) -> bool {
    if !INSTALLED.load(Relaxed) || bytes == 0 {
        return false;
    }
    if !RESERVE.load(Relaxed).is_null() {
        return true;
    }
    let Ok(l) = Layout::from_size_align(bytes, ALIGN) else { return false };
    // SAFETY: a non-zero size; freed by `Reserve::release` with the same layout.
    let p = unsafe { std::alloc::alloc(l) };
    if p.is_null() {
        return false;
    }
    RESERVE_LEN.store(bytes, Relaxed);
    if RESERVE.compare_exchange(std::ptr::null_mut(), p, Relaxed, Relaxed).is_err() {
        // Another thread set one meanwhile.
        // SAFETY: allocated just above with `l`.
        unsafe { std::alloc::dealloc(p, l) };
    }
    true
}

/// Bytes held as the reserve now.
pub fn reserve_bytes() -> usize {
    if RESERVE.load(Relaxed).is_null() { 0 } else { RESERVE_LEN.load(Relaxed) }
}

/// Releases since the last call (the caller adapts its budget to them).
pub fn take_releases() -> usize {
    PENDING.swap(0, Relaxed)
}

/// Every release so far (statistics).
pub fn releases() -> usize {
    RELEASES.load(Relaxed)
}

/// The reserve a budget keeps: 1/32 of it, between 1 and 16 MiB.
pub fn reserve_for(budget: u64) -> usize {
    (budget / 32).clamp(1 << 20, 16 << 20) as usize
}
