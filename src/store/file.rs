//! Native file source using positional reads (`pread`), safe to share across threads, with an
//! optional O_DIRECT mode (Linux) that bypasses the page cache so that the memory budget is the
//! real one and cold-read benchmarks are honest.

use super::{check_range, ByteSource, StoreError};
use std::fs::File;
use std::path::Path;

/// O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical block size.
const DIRECT_ALIGN: usize = 4096;

pub struct FileSource {
    file: File,
    size: u64,
    path: String,
    direct: bool,
}

impl FileSource {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, false)
    }

    /// Open with O_DIRECT where the platform supports it (Linux); elsewhere a normal open.
    pub fn open_direct(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, true)
    }

    fn open_with(path: impl AsRef<Path>, direct: bool) -> Result<Self, StoreError> {
        let p = path.as_ref();
        let ps = p.display().to_string();
        let mut oo = std::fs::OpenOptions::new();
        oo.read(true);
        #[cfg(target_os = "linux")]
        if direct {
            use std::os::unix::fs::OpenOptionsExt;
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = oo.open(p).map_err(|source| StoreError::Open { path: ps.clone(), source })?;
        let size = file.metadata().map_err(|source| StoreError::Open { path: ps.clone(), source })?.len();
        Ok(Self { file, size, path: ps, direct: direct && cfg!(target_os = "linux") })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Read the whole file once through the page cache (1 MiB at a time), so later reads are
    /// memory copies. A device profile ([`crate::store::throttle`]) wraps reads of a warm file:
    /// otherwise the real disk's first reads, slower than the modelled flash, would leak into
    /// the modelled timings.
    pub fn warm_page_cache(&self) -> Result<(), StoreError> {
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        while off < self.size {
            let n = ((self.size - off) as usize).min(buf.len());
            self.read_at(off, &mut buf[..n])?;
            off += n as u64;
        }
        Ok(())
    }

    /// Ask the kernel to drop this file's pages from the page cache (cold-run benchmarks).
    pub fn evict_page_cache(&self) {
        #[cfg(target_os = "linux")]
        unsafe {
            use std::os::unix::io::AsRawFd;
            libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }

    fn pread_full(&self, offset: u64, buf: &mut [u8]) -> Result<usize, StoreError> {
        let mut done = 0usize;
        while done < buf.len() {
            #[cfg(unix)]
            let r = std::os::unix::fs::FileExt::read_at(&self.file, &mut buf[done..], offset + done as u64);
            #[cfg(windows)]
            let r = std::os::windows::fs::FileExt::seek_read(&self.file, &mut buf[done..], offset + done as u64);
            match r {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => return Err(StoreError::Io { offset, len: buf.len(), source }),
            }
        }
        Ok(done)
    }
}

/// Bytes of each reading thread's O_DIRECT bounce buffer.
const BOUNCE_LEN: usize = 1 << 20;

thread_local! {
    static BOUNCE: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
}

/// A heap buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(DIRECT_ALIGN), DIRECT_ALIGN).expect("layout");
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Self { ptr, layout }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl ByteSource for FileSource {
    fn len(&self) -> u64 {
        self.size
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        check_range(offset, buf.len(), self.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        if !self.direct {
            let got = self.pread_full(offset, buf)?;
            if got != buf.len() {
                return Err(StoreError::ShortRead { offset, wanted: buf.len(), got });
            }
            return Ok(());
        }
        // O_DIRECT: read the aligned superset through this thread's aligned bounce buffer, in
        // chunks of its size (a buffer per read as large as the read would be fresh pages to
        // fault in every time, or heap the allocator keeps: memory outside the budget).
        BOUNCE.with(|b| {
            let mut b = b.borrow_mut();
            let bounce = b.get_or_insert_with(|| AlignedBuf::new(BOUNCE_LEN)).as_mut_slice();
            let a = DIRECT_ALIGN as u64;
            let mut done = 0usize;
            while done < buf.len() {
                let at = offset + done as u64;
                let start = at / a * a;
                let skip = (at - start) as usize;
                let take = (BOUNCE_LEN - skip).min(buf.len() - done);
                let span = (skip + take).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
                let got = self.pread_full(start, &mut bounce[..span])?;
                if got < skip + take {
                    return Err(StoreError::ShortRead { offset, wanted: buf.len(), got: done + got.saturating_sub(skip) });
                }
                buf[done..done + take].copy_from_slice(&bounce[skip..skip + take]);
                done += take;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_and_buffered_reads_agree() {
        let p = std::env::temp_dir().join(format!("les-direct-{}.bin", std::process::id()));
        let data: Vec<u8> = (0..3_300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let a = FileSource::open(&p).unwrap();
        let d = FileSource::open_direct(&p).unwrap();
        // Reads longer than the bounce buffer (1 MiB) go through it in chunks.
        for &(o, n) in &[(0u64, 10usize), (4095, 2), (5000, 9000), (19990, 10), (1, 2_500_000), (4095, (1 << 20) + 3), (3_300_000 - 1_048_577, 1_048_577)] {
            let mut x = vec![0u8; n];
            let mut y = vec![0u8; n];
            a.read_at(o, &mut x).unwrap();
            d.read_at(o, &mut y).unwrap();
            assert_eq!(x, &data[o as usize..o as usize + n]);
            assert_eq!(x, y);
        }
        let mut z = vec![0u8; 11];
        assert!(matches!(d.read_at(3_299_990, &mut z), Err(StoreError::OutOfRange { .. })));
        std::fs::remove_file(&p).ok();
    }
}
