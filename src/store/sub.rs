//! [`SubSource`]: a window `[offset, offset + len)` of another byte source, itself a
//! [`ByteSource`] whose offsets start at 0. Used for the dense GGUF embedded in a packed bundle,
//! so the GGUF reader and model loader run on it unchanged.

use super::{check_range, ByteSource, StoreError};

#[derive(Clone, Debug)]
pub struct SubSource<S> {
    inner: S,
    offset: u64,
    len: u64,
}

impl<S: ByteSource> SubSource<S> {
    /// A view of `[offset, offset + len)` of `inner`. Fails with [`StoreError::OutOfRange`]
    /// unless the window lies within `inner`.
    pub fn new(inner: S, offset: u64, len: u64) -> Result<Self, StoreError> {
        let size = inner.len();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(Self { inner, offset, len }),
            _ => Err(StoreError::OutOfRange { offset, len: usize::try_from(len).unwrap_or(usize::MAX), size }),
        }
    }
    /// Where the window starts in the inner source.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn inner(&self) -> &S {
        &self.inner
    }
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: ByteSource> ByteSource for SubSource<S> {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        // Checked against the window, so a read can never reach bytes outside it.
        check_range(offset, buf.len(), self.len)?;
        self.inner.read_at(self.offset + offset, buf)
    }
    fn serves_in_order(&self) -> bool {
        self.inner.serves_in_order()
    }
    fn hint(&self, offset: u64, len: usize) {
        if check_range(offset, len, self.len).is_ok() {
            self.inner.hint(self.offset + offset, len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemSource;

    #[test]
    fn window_reads_and_bounds() {
        let m = MemSource::new((0u8..100).collect());
        let s = SubSource::new(m.clone(), 10, 20).unwrap();
        assert_eq!(s.len(), 20);
        assert_eq!(s.read_vec(0, 3).unwrap(), vec![10, 11, 12]);
        assert_eq!(s.read_vec(17, 3).unwrap(), vec![27, 28, 29]);
        assert!(matches!(s.read_vec(18, 3), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(s.read_vec(u64::MAX, 1), Err(StoreError::OutOfRange { .. })));
        assert!(SubSource::new(m.clone(), 90, 10).is_ok());
        assert!(matches!(SubSource::new(m.clone(), 90, 11), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(SubSource::new(m, u64::MAX, 2), Err(StoreError::OutOfRange { .. })));
    }
}
