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
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::{Acquire, Relaxed, Release}};

/// The reserve block; its first word holds its length.
static RESERVE: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
/// Its length, for statistics.
static HELD: AtomicUsize = AtomicUsize::new(0);
/// Releases not yet handled by a session, and all releases so far.
static PENDING: AtomicUsize = AtomicUsize::new(0);
static RELEASES: AtomicUsize = AtomicUsize::new(0);
/// A [`Reserve`] is the global allocator (so a reserve can be given back).
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Alignment of the reserve block.
const ALIGN: usize = 64;

/// Tests: refuse the n-th allocation of at least `REFUSE_MIN` bytes from now on, once (a heap
/// that cannot grow for a moment). 0: off.
static REFUSE_AT: AtomicUsize = AtomicUsize::new(0);
static REFUSE_MIN: AtomicUsize = AtomicUsize::new(0);

/// Tests (the browser's `debugRefuseAlloc`): refuse the `n`-th allocation of at least `min_bytes`
/// from now on, once, as a heap at its limit would (0: never).
pub fn debug_refuse_once(n: usize, min_bytes: usize) {
    REFUSE_MIN.store(min_bytes, Relaxed);
    REFUSE_AT.store(n, Relaxed);
}

/// Whether the test refusal takes this allocation.
fn refused(size: usize) -> bool {
    if REFUSE_AT.load(Relaxed) == 0 || size < REFUSE_MIN.load(Relaxed) {
        return false;
    }
    REFUSE_AT.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)) == Ok(1)
}

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
        let p = RESERVE.swap(std::ptr::null_mut(), Acquire);
        if p.is_null() {
            return false;
        }
        // SAFETY: `p` was allocated by `set_reserve` through the global allocator (this one, so
        // through `A`) with its length in its first word and this layout, and the swap above
        // hands it to one caller only.
        HELD.store(0, Relaxed);
        unsafe {
            let len = (p as *const usize).read();
            self.0.dealloc(p, Layout::from_size_align_unchecked(len, ALIGN));
        }
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
        let p = if refused(l.size()) { std::ptr::null_mut() } else { unsafe { self.0.alloc(l) } };
        if p.is_null() && self.release() {
            return unsafe { self.0.alloc(l) };
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = if refused(l.size()) { std::ptr::null_mut() } else { unsafe { self.0.alloc_zeroed(l) } };
        if p.is_null() && self.release() {
            return unsafe { self.0.alloc_zeroed(l) };
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { self.0.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let q = if refused(new_size) { std::ptr::null_mut() } else { unsafe { self.0.realloc(p, l, new_size) } };
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
    let Ok(l) = Layout::from_size_align(bytes.max(ALIGN), ALIGN) else { return false };
    // SAFETY: a non-zero size; freed by `Reserve::release` with the same layout, whose size the
    // block's first word holds (aligned to 64, at least 64 bytes).
    let p = unsafe { std::alloc::alloc(l) };
    if p.is_null() {
        return false;
    }
    // SAFETY: the block is at least 64 bytes, aligned to 64: room for its length.
    unsafe { (p as *mut usize).write(l.size()) };
    if RESERVE.compare_exchange(std::ptr::null_mut(), p, Release, Relaxed).is_err() {
        // Another thread set one meanwhile.
        // SAFETY: allocated just above with `l`.
        unsafe { std::alloc::dealloc(p, l) };
    } else {
        HELD.store(l.size(), Relaxed);
    }
    true
}

/// Bytes held as the reserve now.
pub fn reserve_bytes() -> usize {
    HELD.load(Relaxed)
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
