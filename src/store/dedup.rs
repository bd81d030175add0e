//! An in-memory copy of a source that keeps each distinct page once ([`DedupSource`]).
//!
//! Benchmarks that model a device (`les bench ladder --store phone-…`) read from memory so that
//! the device model alone sets read times (the page cache is not a stable stand-in: see
//! `engine::ladder`). A file larger than the machine's memory cannot be copied whole, but the
//! full-size random models of `tools/make_moe.py full` repeat one pool of random blocks inside
//! each large tensor (its `tile_above`): stored page by page, with equal pages shared, their
//! 21.8 GB fit in a few hundred MiB. Reads return exactly the source's bytes: a page is shared
//! only after a byte-for-byte comparison, never on a hash alone. A file without repeats (a
//! trained model) costs its own size plus ~8 bytes per page of index.

use super::{check_range, ByteSource, StoreError};
use std::collections::HashMap;

/// Page size: the GGUF writer's tensor alignment is 32 bytes, but the repeated pools of the
/// random models have periods that are multiples of 16 KiB (4 Mi elements of any block type),
/// so pages of 4 KiB line up with them inside a tensor.
pub const PAGE: usize = 4096;

/// Bytes read from the source at a time while copying.
const PIECE: usize = 16 << 20;

pub struct DedupSource {
    len: u64,
    /// Distinct pages, `PAGE` bytes each (the source's last page zero-padded).
    pages: Vec<u8>,
    /// For each page of the source, its index in `pages`.
    index: Vec<u32>,
}

impl DedupSource {
    /// Copy `src` into memory, page by page. Fails with [`StoreError::OutOfMemory`] when the
    /// distinct pages would exceed `limit` bytes or cannot be allocated.
    pub fn copy_of(src: &dyn ByteSource, limit: u64) -> Result<Self, StoreError> {
        let len = src.len();
        let n_pages = len.div_ceil(PAGE as u64);
        let n_pages = u32::try_from(n_pages).map_err(|_| StoreError::OutOfMemory { offset: 0, len: usize::MAX })?;
        let mut index: Vec<u32> = Vec::new();
        index.try_reserve_exact(n_pages as usize).map_err(|_| StoreError::OutOfMemory { offset: 0, len: n_pages as usize * 4 })?;
        let mut pages: Vec<u8> = Vec::new();
        // First page index by content hash. A hash shared by different contents keeps the first
        // page; later ones are stored on their own (correct, just not shared).
        let mut first: HashMap<u64, u32> = HashMap::new();
        let mut buf = vec![0u8; PIECE.min(len as usize)];
        let mut off = 0u64;
        while off < len {
            let n = ((len - off) as usize).min(PIECE);
            src.read_at(off, &mut buf[..n])?;
            for (k, chunk) in buf[..n].chunks(PAGE).enumerate() {
                let mut page = [0u8; PAGE];
                page[..chunk.len()].copy_from_slice(chunk);
                let h = hash_page(&page);
                let id = match first.get(&h) {
                    Some(&id) if pages[id as usize * PAGE..(id as usize + 1) * PAGE] == page => id,
                    found => {
                        let id = (pages.len() / PAGE) as u32;
                        if pages.len() as u64 + PAGE as u64 > limit {
                            return Err(StoreError::OutOfMemory { offset: off + (k * PAGE) as u64, len: pages.len() + PAGE });
                        }
                        pages.try_reserve(PAGE).map_err(|_| StoreError::OutOfMemory { offset: off + (k * PAGE) as u64, len: pages.len() + PAGE })?;
                        pages.extend_from_slice(&page);
                        if found.is_none() {
                            first.insert(h, id);
                        }
                        id
                    }
                };
                index.push(id);
            }
            off += n as u64;
        }
        pages.shrink_to_fit();
        Ok(Self { len, pages, index })
    }

    /// Bytes this copy holds in memory (distinct pages and the index).
    pub fn resident_bytes(&self) -> u64 {
        (self.pages.len() + self.index.len() * 4) as u64
    }
}

/// FNV-style mixing over 8-byte words (fast; equality is always checked byte for byte).
fn hash_page(p: &[u8; PAGE]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in p.chunks_exact(8) {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    h
}

impl ByteSource for DedupSource {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        check_range(offset, buf.len(), self.len)?;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (pg, within) = ((pos / PAGE as u64) as usize, (pos % PAGE as u64) as usize);
            let n = (PAGE - within).min(buf.len() - done);
            let at = self.index[pg] as usize * PAGE + within;
            buf[done..done + n].copy_from_slice(&self.pages[at..at + n]);
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemSource;

    /// Random bytes with a repeated pool (as `make_moe.py full` writes) and a random tail of odd
    /// length: every read equals the source's bytes, and the repeats are stored once.
    #[test]
    fn reads_equal_the_source_and_repeats_are_stored_once() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        let pool: Vec<u8> = (0..4 * PAGE).map(|_| next()).collect();
        let mut data: Vec<u8> = (0..100).map(|_| next()).collect(); // unaligned start
        for _ in 0..40 {
            data.extend_from_slice(&pool);
        }
        data.extend((0..3 * PAGE + 17).map(|_| next()));
        let src = MemSource::new(data.clone());
        let d = DedupSource::copy_of(&src, u64::MAX).unwrap();
        assert_eq!(d.len(), data.len() as u64);
        // The pool's 4 pages (at each of its page phases: the pool starts 100 bytes in, so
        // pages straddle two pool periods in a fixed way), the edges, the tail.
        let distinct = d.pages.len() / PAGE;
        assert!(distinct <= 4 + 2 + 5, "{distinct} distinct pages for {} pages", d.index.len());
        let mut y = 7u64;
        for _ in 0..2000 {
            y = y.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let off = (y >> 20) % data.len() as u64;
            let len = ((y >> 8) % (3 * PAGE as u64)) as usize;
            let len = len.min(data.len() - off as usize);
            let mut b = vec![0u8; len];
            d.read_at(off, &mut b).unwrap();
            assert_eq!(&b[..], &data[off as usize..off as usize + len], "offset {off} len {len}");
        }
        let mut b = [0u8; 2];
        assert!(matches!(d.read_at(data.len() as u64 - 1, &mut b), Err(StoreError::OutOfRange { .. })));
    }

    /// Distinct pages stay distinct, and a copy larger than its limit is a typed error.
    #[test]
    fn distinct_pages_stay_distinct_and_the_limit_holds() {
        let data: Vec<u8> = (0..8 * PAGE).map(|i| (i / PAGE) as u8).collect();
        let d = DedupSource::copy_of(&MemSource::new(data.clone()), u64::MAX).unwrap();
        assert_eq!(d.pages.len(), 8 * PAGE);
        let mut b = vec![0u8; data.len()];
        d.read_at(0, &mut b).unwrap();
        assert_eq!(b, data);
        assert!(matches!(DedupSource::copy_of(&MemSource::new(data), 4 * PAGE as u64), Err(StoreError::OutOfMemory { .. })));
    }
}
