//! Device profiles: a wrapper over any [`ByteSource`] that models flash storage, so benchmarks
//! are reproducible on any machine. Each read costs `latency + len / bandwidth`, and at most
//! `queue_depth` reads are serviced at once; the bandwidth is shared by the reads in service
//! (a read's transfer time is computed at the device's full rate and the device is a single
//! server of total throughput `bandwidth`).
//!
//! The wrapped reads must be faster than the model (a file in the page cache, memory): the
//! inner read is not hidden, so a cold file on a slower disk would add its own time
//! (`open_streaming` warms the file first).
//!
//! Figures: `phone-1.5GBps` ≈ iPhone 15 Pro flash sequential read (about 1.45 GB/s measured
//! publicly); `phone-4GBps` ≈ recent flagship UFS 4.0 phones; `laptop-nvme` ≈ PCIe 4 NVMe.

#[cfg(not(target_arch = "wasm32"))]
pub use native::Throttled;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceProfile {
    pub name: &'static str,
    /// Bytes per second.
    pub bandwidth: f64,
    /// Per-read latency in seconds.
    pub latency: f64,
    /// Reads serviced concurrently.
    pub queue_depth: usize,
}

pub const PROFILES: &[DeviceProfile] = &[
    DeviceProfile { name: "phone-1.5GBps", bandwidth: 1.5e9, latency: 100e-6, queue_depth: 4 },
    DeviceProfile { name: "phone-4GBps", bandwidth: 4.0e9, latency: 60e-6, queue_depth: 8 },
    DeviceProfile { name: "laptop-nvme", bandwidth: 6.0e9, latency: 30e-6, queue_depth: 32 },
];

impl DeviceProfile {
    pub fn by_name(name: &str) -> Option<Self> {
        PROFILES.iter().copied().find(|p| p.name == name)
    }
    /// Modelled service time of one read of `len` bytes with the device otherwise idle.
    pub fn read_time(&self, len: usize) -> f64 {
        self.latency + len as f64 / self.bandwidth
    }
}

/// The throttled byte source (native: it sleeps; the browser models the same device in
/// `www/les/device.js`).
#[cfg(not(target_arch = "wasm32"))]
mod native {
    use super::DeviceProfile;
    use crate::store::{ByteSource, StoreError};
    use std::sync::{Condvar, Mutex};
    use std::time::{Duration, Instant};

    struct DevState {
        in_service: usize,
        /// When the shared transfer channel is next free.
        channel_free_at: Option<Instant>,
    }
    
    /// A [`ByteSource`] slowed down to a [`DeviceProfile`]. The inner read happens first (its own
    /// time is not hidden); the wrapper then sleeps until the modelled completion time.
    pub struct Throttled<S> {
        inner: S,
        pub profile: DeviceProfile,
        state: Mutex<DevState>,
        cv: Condvar,
    }
    
    impl<S: ByteSource> Throttled<S> {
        pub fn new(inner: S, profile: DeviceProfile) -> Self {
            Self { inner, profile, state: Mutex::new(DevState { in_service: 0, channel_free_at: None }), cv: Condvar::new() }
        }
    }
    
    /// Linux lets a sleeping thread wake up to 50 µs late by default (its timer slack): more than
    /// the modelled latency of a read. Ask for 1 µs on each thread that sleeps in a device model.
    fn precise_timer_slack() {
        #[cfg(target_os = "linux")]
        {
            thread_local!(static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
            SET.with(|s| {
                if !s.get() {
                    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and only affects this thread.
                    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
                    s.set(true);
                }
            });
        }
    }
    
    impl<S: ByteSource> ByteSource for Throttled<S> {
        fn len(&self) -> u64 {
            self.inner.len()
        }
        /// The model's transfers are served in admission order on one channel.
        fn serves_in_order(&self) -> bool {
            true
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
            let start = Instant::now();
            // Admission: at most queue_depth reads in service.
            let done_at = {
                let mut st = self.state.lock().unwrap();
                while st.in_service >= self.profile.queue_depth.max(1) {
                    st = self.cv.wait(st).unwrap();
                }
                st.in_service += 1;
                // Latency overlaps with other reads; the transfer serialises on the channel.
                let ready = start + Duration::from_secs_f64(self.profile.latency);
                let xfer_start = match st.channel_free_at {
                    Some(t) if t > ready => t,
                    _ => ready,
                };
                let done = xfer_start + Duration::from_secs_f64(buf.len() as f64 / self.profile.bandwidth);
                st.channel_free_at = Some(done);
                done
            };
            let r = self.inner.read_at(offset, buf);
            let now = Instant::now();
            if done_at > now {
                precise_timer_slack();
                std::thread::sleep(done_at - now);
            }
            let mut st = self.state.lock().unwrap();
            st.in_service -= 1;
            self.cv.notify_one();
            r
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use crate::store::{ByteSource, MemSource};

    #[test]
    fn profile_time_follows_bandwidth_and_latency() {
        let p = DeviceProfile { name: "t", bandwidth: 1e8, latency: 2e-3, queue_depth: 1 };
        let s = Throttled::new(MemSource::new(vec![0u8; 1 << 20]), p);
        let mut b = vec![0u8; 1_000_000];
        let t = Instant::now();
        s.read_at(0, &mut b).unwrap();
        let dt = t.elapsed().as_secs_f64();
        // 2 ms + 10 ms.
        assert!(dt >= 0.012 && dt < 0.05, "took {dt}");
    }

    #[test]
    fn concurrent_reads_share_bandwidth() {
        let p = DeviceProfile { name: "t", bandwidth: 1e8, latency: 0.0, queue_depth: 4 };
        let s = std::sync::Arc::new(Throttled::new(MemSource::new(vec![0u8; 1 << 20]), p));
        let t = Instant::now();
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut b = vec![0u8; 500_000];
                    s.read_at(0, &mut b).unwrap();
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
        let dt = t.elapsed().as_secs_f64();
        // 4 × 5 ms transfers on one channel: ≥ 20 ms.
        assert!(dt >= 0.02 && dt < 0.08, "took {dt}");
    }
}
