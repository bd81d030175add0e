//! Native file source using positional reads (`pread`), safe to share across threads.

use super::{check_range, ByteSource, StoreError};
use std::fs::File;
use std::path::Path;

pub struct FileSource {
    file: File,
    size: u64,
    path: String,
}

impl FileSource {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let p = path.as_ref();
        let ps = p.display().to_string();
        let file = File::open(p).map_err(|source| StoreError::Open { path: ps.clone(), source })?;
        let size = file
            .metadata()
            .map_err(|source| StoreError::Open { path: ps.clone(), source })?
            .len();
        Ok(Self { file, size, path: ps })
    }
    pub fn path(&self) -> &str {
        &self.path
    }
}

impl ByteSource for FileSource {
    fn len(&self) -> u64 {
        self.size
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        check_range(offset, buf.len(), self.size)?;
        let mut done = 0usize;
        while done < buf.len() {
            #[cfg(unix)]
            let r = std::os::unix::fs::FileExt::read_at(&self.file, &mut buf[done..], offset + done as u64);
            #[cfg(windows)]
            let r = std::os::windows::fs::FileExt::seek_read(&self.file, &mut buf[done..], offset + done as u64);
            match r {
                Ok(0) => {
                    return Err(StoreError::ShortRead { offset, wanted: buf.len(), got: done });
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => return Err(StoreError::Io { offset, len: buf.len(), source }),
            }
        }
        Ok(())
    }
}
