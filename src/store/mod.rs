//! Byte sources: everything LES reads (GGUF headers, dense tensors, experts) goes through
//! [`ByteSource`], a positional-read trait (offset, length -> bytes). The same GGUF reader and
//! expert store therefore run over a native file, an in-memory buffer, or (in the browser)
//! OPFS / IndexedDB / HTTP range sources.

use std::sync::Arc;

#[cfg(not(target_arch = "wasm32"))]
mod file;
pub mod ahead;
#[cfg(not(target_arch = "wasm32"))]
pub mod dedup;
pub mod throttle;
#[cfg(not(target_arch = "wasm32"))]
pub use file::FileSource;

/// Errors from a byte source. Every variant carries enough context to print one clear line.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open {path}: {source}")]
    Open { path: String, source: std::io::Error },
    #[error("read of {len} bytes at offset {offset} failed: {source}")]
    Io { offset: u64, len: usize, source: std::io::Error },
    #[error("read of {len} bytes at offset {offset} is past the end of the source ({size} bytes)")]
    OutOfRange { offset: u64, len: usize, size: u64 },
    #[error("short read at offset {offset}: wanted {wanted} bytes, got {got}")]
    ShortRead { offset: u64, wanted: usize, got: usize },
    /// The buffer for a read could not be allocated (a heap at its limit: the browser's wasm
    /// memory, a phone's app allowance).
    #[error("out of memory: cannot allocate {len} bytes for a read at offset {offset}")]
    OutOfMemory { offset: u64, len: usize },
}

/// A random-access, read-only source of bytes.
///
/// Implementations must be safe to call from several threads at once (reads are positional).
pub trait ByteSource: Send + Sync {
    /// Total size in bytes.
    fn len(&self) -> u64;
    /// Fill `buf` with the bytes at `[offset, offset + buf.len())`. Reading past the end is an
    /// error ([`StoreError::OutOfRange`]); a partial read is an error, never silently zero-filled.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError>;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Lookahead: `[offset, offset + len)` will probably be read soon. Sources that can fetch
    /// in the background (the browser's range store) start now; others ignore it.
    fn hint(&self, _offset: u64, _len: usize) {}
    /// Every block this source returns had its bundle checksum verified when it was stored (the
    /// browser's OPFS / IndexedDB store checks each block's CRC-32 before marking it present):
    /// the bundle's expert store need not check it again on every read.
    fn verified_at_rest(&self) -> bool {
        false
    }
    /// The source serves reads one after another in the order they were submitted (one transfer
    /// channel behind a FIFO queue, as [`throttle::Throttled`] models a flash device): a read
    /// submitted later cannot slow one already in service. The streaming cache then lets a
    /// prefetch start while a demand read is in flight (it queues behind it). Sources that
    /// share their bandwidth between concurrent reads (a real disk here: a concurrent prefetch
    /// measurably slowed demand reads, BENCHMARKS.md "Prefetch governor") answer `false`, and
    /// prefetches wait until no demand read is in flight.
    fn serves_in_order(&self) -> bool {
        false
    }
    /// Read a range into a new vector. The length is checked against the source size before
    /// allocating, so a hostile length cannot cause an allocation larger than the source.
    fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, StoreError> {
        check_range(offset, len, self.len())?;
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| StoreError::OutOfMemory { offset, len })?;
        v.resize(len, 0);
        self.read_at(offset, &mut v)?;
        Ok(v)
    }
}

/// Returns `OutOfRange` unless `[offset, offset+len)` lies within `size`.
pub fn check_range(offset: u64, len: usize, size: u64) -> Result<(), StoreError> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(StoreError::OutOfRange { offset, len, size }),
    }
}

impl<T: ByteSource + ?Sized> ByteSource for Arc<T> {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn hint(&self, offset: u64, len: usize) {
        (**self).hint(offset, len)
    }
    fn verified_at_rest(&self) -> bool {
        (**self).verified_at_rest()
    }
    fn serves_in_order(&self) -> bool {
        (**self).serves_in_order()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        (**self).read_at(offset, buf)
    }
}

impl<T: ByteSource + ?Sized> ByteSource for Box<T> {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn hint(&self, offset: u64, len: usize) {
        (**self).hint(offset, len)
    }
    fn verified_at_rest(&self) -> bool {
        (**self).verified_at_rest()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        (**self).read_at(offset, buf)
    }
}

/// An in-memory source (tests, small models, and the browser's fully downloaded buffers).
#[derive(Clone, Debug, Default)]
pub struct MemSource {
    data: Arc<Vec<u8>>,
}

impl MemSource {
    pub fn new(data: Vec<u8>) -> Self {
        Self { data: Arc::new(data) }
    }
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

impl ByteSource for MemSource {
    fn len(&self) -> u64 {
        self.data.len() as u64
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        check_range(offset, buf.len(), self.len())?;
        let o = offset as usize;
        buf.copy_from_slice(&self.data[o..o + buf.len()]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_source_rejects_out_of_range() {
        let s = MemSource::new(vec![1, 2, 3, 4]);
        let mut b = [0u8; 2];
        s.read_at(2, &mut b).unwrap();
        assert_eq!(b, [3, 4]);
        assert!(matches!(s.read_at(3, &mut b), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(s.read_vec(u64::MAX, 2), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(s.read_vec(0, usize::MAX), Err(StoreError::OutOfRange { .. })));
    }
}
pub mod sub;
pub mod fault;
