//! What one decode token costs on a GPU (`les plan --backend wgpu --device PROFILE`): the calls
//! the wgpu backend makes per token ([`GpuRates`], counted by the backend itself on a real
//! forward of the model: [`super::plan::probe_gpu`]) priced with a device's per-call costs, plus
//! the weights the token reads at the device's memory bandwidth, plus the expert reads the
//! budget leaves (the storage model of [`super::plan`]).
//!
//! The model is serial, as the backend runs a decode token today: the host records a segment,
//! submits it, and waits for its readback before it can route the next MoE layer, so neither
//! side's time hides the other's across a synchronisation:
//!
//! `t = readbacks · sync + submits · submit + dispatches · (dispatch_cpu + dispatch_gpu)
//!      + bind_groups · bind_group + weight_bytes / bandwidth + reads`
//!
//! Each profile's constants carry their source. Where no published figure exists the constant
//! is an estimate and says so; `les bench gpu-probe` measures sync, dispatch and bandwidth on
//! the adapter at hand ([`crate::backend::wgpu::probe`]), and [`GpuDevice::measured`] turns a
//! probe into a profile.

use crate::backend::wgpu::GpuRates;
use serde::Serialize;

/// A GPU's per-call costs and rates.
#[derive(Clone, Debug, Serialize)]
pub struct GpuDevice {
    pub name: String,
    pub what: String,
    /// One GPU→CPU synchronisation with the GPU otherwise idle: submit, map, wait (ms).
    pub sync_ms: f64,
    /// One `queue.submit` on the host (µs).
    pub submit_us: f64,
    /// Recording one dispatch on the host: pipeline, bind group, dispatch, validation (µs).
    pub dispatch_cpu_us: f64,
    /// One dispatch on the GPU beyond its memory traffic: launch and the barrier between
    /// dependent dispatches (µs).
    pub dispatch_gpu_us: f64,
    /// Creating one bind group (µs).
    pub bind_group_us: f64,
    /// Bytes per second a one-token matvec reads weights at.
    pub bandwidth: f64,
    /// The storage profile experts are read from (`store::throttle::PROFILES`).
    pub store: &'static str,
    /// Where each constant comes from.
    pub sources: Vec<&'static str>,
}

/// The profiles `les plan --device` knows.
pub fn profiles() -> Vec<GpuDevice> {
    vec![
        GpuDevice {
            name: "iphone-metal".into(),
            what: "an iPhone 15 Pro-class phone (A17 Pro), wgpu on Metal, experts on phone flash".into(),
            sync_ms: 0.2,
            submit_us: 20.0,
            dispatch_cpu_us: 5.0,
            dispatch_gpu_us: 3.0,
            bind_group_us: 5.0,
            // 51.2 GB/s peak (LPDDR5-6400, 64-bit bus) at 70% for a matvec.
            bandwidth: 0.7 * 51.2e9,
            store: "phone-4GBps",
            sources: vec![
                "sync: a Metal command-buffer wait through wgpu-hal 30 costs 0.1-0.3 ms (../shared/research/gpu_path.md); 0.2 ms taken",
                "submit, dispatch, bind group: estimates (no published per-call figure for wgpu on iOS); replace with `les bench gpu-probe` on the device",
                "dispatch_gpu: Apple's TBDR GPUs pay per compute encoder, not per dispatch within one (gpuweb#2046: A14, 100 one-dispatch passes cost 95% more GPU time than one pass); 3 us per dependent dispatch is an estimate",
                "bandwidth: Apple A17 Pro, LPDDR5-6400 on a 64-bit bus = 51.2 GB/s peak; 70% reached by a matvec is an assumption",
            ],
        },
        GpuDevice {
            name: "chrome-apple-silicon".into(),
            what: "Chrome (Dawn, WebGPU) on an M1/M2-class Mac laptop, experts in OPFS on NVMe".into(),
            sync_ms: 0.47,
            submit_us: 50.0,
            dispatch_cpu_us: 40.0,
            dispatch_gpu_us: 3.0,
            bind_group_us: 10.0,
            // 100 GB/s (M2, LPDDR5-6400, 128-bit) at 70%.
            bandwidth: 0.7 * 100e9,
            store: "laptop-nvme",
            sources: vec![
                "sync: submit + mapAsync round trip 0.47 ms in Chrome on an M1 Max (jax-js PR #124, via ../shared/research/gpu_path.md)",
                "dispatch_cpu: 100 dispatches cost ~4 ms of host time in Chrome (../shared/research/gpu_path.md); tract PR #2902 measured 3-4 us per wgpu handle clone on the web backend, ~20 us of a dispatch's host path",
                "submit, bind group: estimates",
                "bandwidth: Apple M2, 100 GB/s peak; 70% is an assumption",
            ],
        },
        GpuDevice {
            name: "chrome-discrete".into(),
            what: "Chrome (Dawn, WebGPU) on a Windows/Linux laptop with an Intel or NVIDIA GPU".into(),
            sync_ms: 10.0,
            submit_us: 50.0,
            dispatch_cpu_us: 40.0,
            dispatch_gpu_us: 5.0,
            bind_group_us: 10.0,
            bandwidth: 0.7 * 100e9,
            store: "laptop-nvme",
            sources: vec![
                "sync: 5-15 ms per mapAsync round trip reported on Intel and NVIDIA (gpuweb#4432); 10 ms taken",
                "dispatch_cpu: as chrome-apple-silicon",
                "bandwidth: 100 GB/s at 70%, an assumption for a mid-range laptop GPU",
            ],
        },
        GpuDevice {
            name: "firefox-apple-silicon".into(),
            what: "Firefox (wgpu, WebGPU) on an M1/M2-class Mac".into(),
            sync_ms: 100.0,
            submit_us: 50.0,
            dispatch_cpu_us: 40.0,
            dispatch_gpu_us: 3.0,
            bind_group_us: 10.0,
            bandwidth: 0.7 * 100e9,
            store: "laptop-nvme",
            sources: vec![
                "sync: Firefox resolves WebGPU completions on a ~100 ms poll (bugzilla 1870699; jax-js PR #124)",
                "the rest as chrome-apple-silicon",
            ],
        },
    ]
}

impl GpuDevice {
    pub fn by_name(name: &str) -> Option<Self> {
        profiles().into_iter().find(|p| p.name == name)
    }

    /// A profile from `les bench gpu-probe`'s measurements on this adapter: the sync, the
    /// dispatch (host and device together, so `dispatch_gpu_us` 0), the matvec's bandwidth.
    pub fn measured(p: &crate::backend::wgpu::probe::GpuProbe, store: &'static str) -> Self {
        GpuDevice {
            name: "this-adapter".into(),
            what: format!("measured now: {}", p.adapter),
            sync_ms: p.sync_ms,
            submit_us: 0.0,
            dispatch_cpu_us: p.dispatch_us,
            dispatch_gpu_us: 0.0,
            bind_group_us: 0.0,
            bandwidth: p.bandwidth,
            store,
            sources: vec!["les bench gpu-probe on this adapter (crate::backend::wgpu::probe)"],
        }
    }
}

/// One decode token on a device, by cost.
#[derive(Clone, Debug, Serialize)]
pub struct GpuBreakdown {
    pub device: String,
    pub per_token: GpuRates,
    /// Weights a decode token reads (dense matrices on the device, plus k experts per MoE layer).
    pub weight_bytes: f64,
    pub sync_ms: f64,
    pub submit_ms: f64,
    pub dispatch_ms: f64,
    pub bind_group_ms: f64,
    pub bandwidth_ms: f64,
    pub read_ms: f64,
    pub total_ms: f64,
    pub tokens_per_s: f64,
    /// The bandwidth floor alone (what the hardware allows with no per-call cost and no reads).
    pub floor_tokens_per_s: f64,
}

/// Price one decode token's calls and bytes on `dev`; `read_ms`: the expert reads per token.
pub fn price(dev: &GpuDevice, per_token: GpuRates, weight_bytes: f64, read_ms: f64) -> GpuBreakdown {
    let sync_ms = per_token.readbacks * dev.sync_ms;
    let submit_ms = per_token.submits * dev.submit_us / 1000.0;
    let dispatch_ms = per_token.dispatches * (dev.dispatch_cpu_us + dev.dispatch_gpu_us) / 1000.0;
    let bind_group_ms = per_token.bind_groups * dev.bind_group_us / 1000.0;
    let bandwidth_ms = weight_bytes / dev.bandwidth * 1000.0;
    let total_ms = sync_ms + submit_ms + dispatch_ms + bind_group_ms + bandwidth_ms + read_ms;
    GpuBreakdown {
        device: dev.name.clone(),
        per_token,
        weight_bytes,
        sync_ms,
        submit_ms,
        dispatch_ms,
        bind_group_ms,
        bandwidth_ms,
        read_ms,
        total_ms,
        tokens_per_s: 1000.0 / total_ms.max(1e-9),
        floor_tokens_per_s: 1000.0 / bandwidth_ms.max(1e-9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn price_adds_each_calls_cost() {
        let dev = GpuDevice { name: "t".into(), what: String::new(), sync_ms: 0.5, submit_us: 100.0, dispatch_cpu_us: 30.0, dispatch_gpu_us: 10.0, bind_group_us: 20.0, bandwidth: 1e9, store: "laptop-nvme", sources: vec![] };
        let r = GpuRates { submits: 2.0, readbacks: 4.0, dispatches: 100.0, bind_groups: 10.0, ..Default::default() };
        let b = price(&dev, r, 5e6, 1.5);
        // 4 × 0.5 + 2 × 0.1 + 100 × 0.04 + 10 × 0.02 + 5 MB / 1 GB/s + 1.5
        assert!((b.total_ms - (2.0 + 0.2 + 4.0 + 0.2 + 5.0 + 1.5)).abs() < 1e-9, "{b:?}");
        assert!((b.floor_tokens_per_s - 200.0).abs() < 1e-9);
    }

    #[test]
    fn every_profile_names_its_storage_and_sources() {
        for p in profiles() {
            assert!(crate::store::throttle::DeviceProfile::by_name(p.store).is_some(), "{}", p.name);
            assert!(!p.sources.is_empty() && p.bandwidth > 0.0 && p.sync_ms > 0.0, "{}", p.name);
        }
    }
}
