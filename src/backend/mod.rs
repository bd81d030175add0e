//! Compute backends. [`ops`] is the contract a forward pass is written against; `cpu` is the
//! reference (and the fast native path); `wgpu` runs the same ops with WGSL kernels (WebGPU,
//! Metal, Vulkan, DX12), each kernel tested against its CPU reference (`tests/portable/ops.rs`).
//! Backends know ops and shapes, never architectures (those live in `src/model/`).

pub mod cpu;
pub mod ops;
pub mod profile;
pub mod rope;
pub mod wgpu;

/// Which backend runs the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendKind {
    Cpu,
    Wgpu,
    /// wgpu when an adapter exists, else the CPU.
    #[default]
    Auto,
}

impl BackendKind {
    /// Whether this choice runs on a GPU (wgpu, or auto finding a hardware adapter): a memory
    /// budget then keeps the expert cache in GPU slots behind a small CPU staging cache.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn runs_on_gpu(self) -> bool {
        match self {
            Self::Cpu => false,
            Self::Wgpu => true,
            Self::Auto => wgpu::GpuContext::probe().is_ok_and(|i| wgpu::GpuContext::auto_takes(&i)),
        }
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "wgpu" | "gpu" | "webgpu" => Ok(Self::Wgpu),
            "auto" => Ok(Self::Auto),
            _ => Err(format!("unknown backend '{s}' (cpu, wgpu, auto)")),
        }
    }
}
