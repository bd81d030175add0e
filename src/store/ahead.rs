//! Read-ahead over a fixed cycle of byte ranges: the dense weights a memory budget cannot hold,
//! read from storage in the order every forward pass uses them (layer by layer, then the output
//! matrix; the cycle repeats each token). The order is known exactly, so unlike experts these
//! reads are never speculative: a reader thread keeps the next pieces of the cycle loaded within a
//! byte window while the caller computes with the current one.
//!
//! [`ReadAhead::get`] hands piece `i` over: at once when the reader has it, after waiting when
//! the reader is on it, and read on the caller's thread when the caller left the cycle (a
//! prompt chunk that skips the output matrix; the first token). Pieces before `i` in the cycle
//! are dropped. Held bytes (pieces loaded or being loaded) stay within the window, except that
//! one piece is always allowed; a piece the caller still holds counts until its next `get`.
//! A failed background read is retried on the caller's thread, whose error is returned.

use super::{ByteSource, StoreError};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

/// What the read-ahead did (for `les run --verbose` and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AheadStats {
    /// Pieces handed over by `get`.
    pub gets: u64,
    /// Of those, pieces read on the caller's thread (not read ahead).
    pub misses: u64,
    /// Of those, pieces the caller waited for while the reader read them.
    pub waits: u64,
    /// Bytes read, by either thread.
    pub bytes_read: u64,
    /// Largest number of bytes held at once.
    pub peak_bytes: u64,
}

struct Slot {
    idx: usize,
    /// `None` while being read; `Some(None)` when the read failed.
    data: Option<Option<Arc<Vec<u8>>>>,
}

struct State {
    /// Pieces held, consecutive in cycle order.
    held: VecDeque<Slot>,
    /// Cycle index of the first held piece (the next one to read when none are held).
    head: usize,
    /// Bytes of `held`, plus a background read whose slot was cleared by a miss.
    bytes: usize,
    /// Bumped when a miss clears `held` (a background read of an older generation is dropped).
    gen: u64,
    stop: bool,
    /// The reader thread ended (a panic in a source): callers read every piece themselves.
    dead: bool,
    stats: AheadStats,
    /// Buffers of pieces let go, kept for the next reads while held + spare bytes fit the
    /// window (fresh buffers would be fresh pages to fault in, or heap the allocator keeps).
    spare: Vec<Vec<u8>>,
}

impl State {
    /// Let go of a held piece's bytes: keep its buffer as a spare when the window has room.
    fn release(&mut self, d: Arc<Vec<u8>>, window: usize) {
        if let Ok(v) = Arc::try_unwrap(d) {
            let spare: usize = self.spare.iter().map(|b| b.capacity()).sum();
            if self.bytes + spare + v.capacity() <= window {
                self.spare.push(v);
            }
        }
    }

    /// A spare buffer for a piece of `len` bytes, the closest fit (empty when none is large
    /// enough: the spares are dropped, so held + spare bytes stay within the window). Size it
    /// with [`fit`] outside the lock.
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        match self.spare.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i) {
            Some(i) => self.spare.swap_remove(i),
            None => {
                self.spare.clear();
                Vec::new()
            }
        }
    }
}

/// `v` holding exactly `len` bytes: a larger spare gives its tail back (its pages must not stay
/// resident beyond the piece's length, which is what the window counts).
fn fit(mut v: Vec<u8>, len: usize) -> Vec<u8> {
    v.resize(len, 0);
    v.shrink_to(len);
    v
}

struct Inner {
    /// Held by `get` throughout: one caller at a time (the bookkeeping assumes it).
    caller: Mutex<()>,
    src: Arc<dyn ByteSource>,
    /// A reader thread runs (else every piece is read by `get`).
    background: bool,
    pieces: Vec<(u64, usize)>,
    window: usize,
    st: Mutex<State>,
    cv: Condvar,
}

/// See the module documentation.
pub struct ReadAhead {
    inner: Arc<Inner>,
    #[cfg(not(target_arch = "wasm32"))]
    reader: Option<std::thread::JoinHandle<()>>,
}

impl ReadAhead {
    /// A read-ahead over `pieces` (offset, length) of `src`, in cycle order, holding at most
    /// `window` bytes (at least one piece). `background`: run a reader thread (native only;
    /// without one every piece is read by `get`). Every range is checked against `src` here.
    pub fn new(src: Arc<dyn ByteSource>, pieces: Vec<(u64, usize)>, window: usize, background: bool) -> Result<Self, StoreError> {
        for &(o, l) in &pieces {
            super::check_range(o, l, src.len())?;
        }
        let background = background && cfg!(not(target_arch = "wasm32")) && !pieces.is_empty();
        let inner = Arc::new(Inner {
            caller: Mutex::new(()),
            src,
            background,
            pieces,
            window,
            st: Mutex::new(State { held: VecDeque::new(), head: 0, bytes: 0, gen: 0, stop: false, dead: false, stats: AheadStats::default(), spare: Vec::new() }),
            cv: Condvar::new(),
        });
        #[cfg(not(target_arch = "wasm32"))]
        {
            let reader = if background {
                let i = inner.clone();
                Some(std::thread::Builder::new().name("les-read-ahead".into()).spawn(move || i.run()).map_err(|e| StoreError::Io { offset: 0, len: 0, source: e })?)
            } else {
                None
            };
            Ok(Self { inner, reader })
        }
        #[cfg(target_arch = "wasm32")]
        {
            let _ = background;
            Ok(Self { inner })
        }
    }

    pub fn n_pieces(&self) -> usize {
        self.inner.pieces.len()
    }

    /// The source pieces are read from (row reads that bypass the cycle: embedding lookups).
    pub fn source(&self) -> &Arc<dyn ByteSource> {
        &self.inner.src
    }

    pub fn stats(&self) -> AheadStats {
        self.inner.st.lock().unwrap_or_else(|e| e.into_inner()).stats
    }

    /// Piece `i`'s bytes (see the module documentation).
    pub fn get(&self, i: usize) -> Result<Arc<Vec<u8>>, StoreError> {
        let inner = &*self.inner;
        let Some(&(off, len)) = inner.pieces.get(i) else {
            return Err(StoreError::OutOfRange { offset: i as u64, len: 0, size: inner.pieces.len() as u64 });
        };
        let _one = inner.caller.lock().unwrap_or_else(|e| e.into_inner());
        let mut st = inner.lock();
        st.stats.gets += 1;
        let mut waited = false;
        loop {
            if let Some(pos) = st.held.iter().position(|s| s.idx == i) {
                for _ in 0..pos {
                    let s = st.held.pop_front().expect("position within held");
                    st.bytes -= inner.pieces[s.idx].1;
                    if let Some(Some(d)) = s.data {
                        st.release(d, inner.window);
                    }
                }
                st.head = i;
                inner.cv.notify_all();
                match &st.held[0].data {
                    Some(Some(d)) => return Ok(d.clone()),
                    Some(None) => break, // the background read failed: retry here
                    None if st.dead => break,
                    None => {
                        if !waited {
                            st.stats.waits += 1;
                            waited = true;
                        }
                        st = inner.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                    }
                }
            } else if inner.background && !st.dead && i == (st.head + st.held.len()) % inner.pieces.len() {
                // The reader's next piece: let go of what is held (all before `i`) and wait.
                let dropped: usize = st.held.iter().filter(|s| s.data.is_some()).map(|s| inner.pieces[s.idx].1).sum();
                if dropped < st.held.iter().map(|s| inner.pieces[s.idx].1).sum::<usize>() && !st.dead {
                    // A piece before `i` is still being read; wait for it to land first.
                    st = inner.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                    continue;
                }
                st.bytes -= dropped;
                for s in std::mem::take(&mut st.held) {
                    if let Some(Some(d)) = s.data {
                        st.release(d, inner.window);
                    }
                }
                st.head = i;
                inner.cv.notify_all();
                if !waited {
                    st.stats.waits += 1;
                    waited = true;
                }
                st = inner.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            } else {
                st.stats.misses += 1;
                break;
            }
        }
        // Read here: the cycle restarts at `i` (the reader goes on from `i + 1`).
        st.gen += 1;
        let dropped: usize = st.held.iter().filter(|s| s.data.is_some()).map(|s| inner.pieces[s.idx].1).sum();
        st.bytes -= dropped; // a slot being read keeps its bytes until its reader lets go
        for s in std::mem::take(&mut st.held) {
            if let Some(Some(d)) = s.data {
                st.release(d, inner.window);
            }
        }
        st.head = i;
        st.held.push_back(Slot { idx: i, data: None });
        st.bytes += len;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.bytes as u64);
        let gen = st.gen;
        let buf = st.buffer(len);
        inner.cv.notify_all(); // room was made: the reader may go on with the next pieces
        drop(st);
        let mut buf = fit(buf, len);
        let r = inner.src.read_at(off, &mut buf).map(|_| buf);
        let mut st = inner.lock();
        st.stats.bytes_read += len as u64;
        let out = r.map(Arc::new);
        if st.gen == gen {
            if let Some(s) = st.held.iter_mut().find(|s| s.idx == i) {
                s.data = Some(out.as_ref().ok().cloned());
            }
        } else {
            st.bytes -= len; // cleared by another caller's miss while being read
        }
        inner.cv.notify_all();
        out
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reader thread: read the cycle's next piece whenever the window has room for it.
    #[cfg(not(target_arch = "wasm32"))]
    fn run(&self) {
        /// Tells the callers when the reader ends, however it ends (a panicking source).
        struct Dead<'a>(&'a Inner);
        impl Drop for Dead<'_> {
            fn drop(&mut self) {
                self.0.lock().dead = true;
                self.0.cv.notify_all();
            }
        }
        let _dead = Dead(self);
        let n = self.pieces.len();
        let mut st = self.lock();
        loop {
            if st.stop {
                return;
            }
            let next = (st.head + st.held.len()) % n;
            let size = self.pieces[next].1;
            if st.held.len() >= n || (st.bytes + size > self.window && !st.held.is_empty()) {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            st.held.push_back(Slot { idx: next, data: None });
            st.bytes += size;
            st.stats.peak_bytes = st.stats.peak_bytes.max(st.bytes as u64);
            let gen = st.gen;
            let (off, len) = self.pieces[next];
            let buf = st.buffer(len);
            drop(st);
            let mut buf = fit(buf, len);
            let r = self.src.read_at(off, &mut buf).map(|_| buf);
            st = self.lock();
            st.stats.bytes_read += len as u64;
            if st.gen == gen {
                if let Some(s) = st.held.iter_mut().find(|s| s.idx == next && s.data.is_none()) {
                    s.data = Some(r.ok().map(Arc::new));
                }
            } else {
                st.bytes -= size; // cleared by a miss while being read
            }
            self.cv.notify_all();
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.inner.lock().stop = true;
        self.inner.cv.notify_all();
        #[cfg(not(target_arch = "wasm32"))]
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fault::{FaultySource, Rule};
    use crate::store::MemSource;

    fn source(n: usize) -> Arc<dyn ByteSource> {
        Arc::new(MemSource::new((0..n).map(|i| (i * 7 % 251) as u8).collect()))
    }

    #[test]
    fn hands_over_every_piece_in_and_out_of_order_within_the_window() {
        let src = source(10_000);
        let pieces: Vec<(u64, usize)> = (0..20).map(|i| (i * 400 + 13, 300 + (i as usize % 3) * 50)).collect();
        for background in [false, true] {
            let ra = ReadAhead::new(src.clone(), pieces.clone(), 1000, background).unwrap();
            // Three cycles in order, then jumps (a chunk that skips pieces, a restart).
            let order: Vec<usize> = (0..60).map(|k| k % 20).chain([5, 6, 19, 0, 1, 7, 7, 3]).collect();
            for &i in &order {
                let (o, l) = pieces[i];
                let got = ra.get(i).unwrap();
                assert_eq!(&got[..], &src.read_vec(o, l).unwrap()[..], "piece {i}");
            }
            let s = ra.stats();
            assert_eq!(s.gets, order.len() as u64);
            // One piece (400 bytes at most) may be read past the window when a miss cleared it.
            assert!(s.peak_bytes <= 1000 + 400, "peak {}", s.peak_bytes);
            if !background {
                assert_eq!(s.misses, s.gets - 1, "without a reader every piece but a repeated one is read by get");
            }
        }
    }

    /// Two threads taking pieces at once each get the right bytes (callers are serialised).
    #[test]
    fn concurrent_callers_get_the_right_bytes() {
        let src = source(20_000);
        let pieces: Vec<(u64, usize)> = (0..40).map(|i| (i * 480, 333 + i as usize)).collect();
        let ra = ReadAhead::new(src.clone(), pieces.clone(), 1500, true).unwrap();
        std::thread::scope(|s| {
            for t in 0..2 {
                let (ra, src, pieces) = (&ra, &src, &pieces);
                s.spawn(move || {
                    for k in 0..400 {
                        let i = (k * (t + 1)) % pieces.len();
                        let (o, l) = pieces[i];
                        assert_eq!(&ra.get(i).unwrap()[..], &src.read_vec(o, l).unwrap()[..]);
                    }
                });
            }
        });
        assert!(ra.stats().peak_bytes <= 1500 + 400);
    }

    /// A source that panics on the reader thread: callers read the pieces themselves.
    #[test]
    fn a_reader_that_dies_leaves_the_callers_reading() {
        struct PanicsOnReader(Arc<dyn ByteSource>);
        impl ByteSource for PanicsOnReader {
            fn len(&self) -> u64 {
                self.0.len()
            }
            fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
                if std::thread::current().name() == Some("les-read-ahead") {
                    panic!("injected: a source bug on the reader thread");
                }
                self.0.read_at(offset, buf)
            }
        }
        let src = source(4000);
        let ra = ReadAhead::new(Arc::new(PanicsOnReader(src.clone())), vec![(0, 500), (500, 500), (1000, 500)], 2000, true).unwrap();
        for _ in 0..2 {
            for (i, o) in [0u64, 500, 1000].into_iter().enumerate() {
                assert_eq!(&ra.get(i).unwrap()[..], &src.read_vec(o, 500).unwrap()[..]);
            }
        }
    }

    #[test]
    fn a_failing_source_gives_the_error_and_the_reader_survives() {
        let src = source(4000);
        let faulty: Arc<dyn ByteSource> = Arc::new(FaultySource::new(src.clone(), 1).with(Rule::error_on_range(1000, 1100)));
        let pieces = vec![(0u64, 500usize), (1000, 500), (2000, 500)];
        let ra = ReadAhead::new(faulty, pieces, 2000, true).unwrap();
        for _ in 0..3 {
            assert!(ra.get(0).is_ok());
            assert!(matches!(ra.get(1), Err(StoreError::Io { .. })));
            assert_eq!(&ra.get(2).unwrap()[..], &src.read_vec(2000, 500).unwrap()[..]);
        }
        assert!(ReadAhead::new(src, vec![(3900, 200)], 1000, true).is_err(), "ranges are checked up front");
    }
}
