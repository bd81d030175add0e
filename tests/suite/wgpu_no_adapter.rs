//! With no usable adapter (WGPU_BACKEND names a backend this machine lacks), the wgpu backend
//! gives a clear error and `auto` falls back to the CPU. The variable holds for a whole process,
//! so the test runs itself again in a child process with it set.

use les::backend::wgpu::exec::GpuOptions;
use les::backend::BackendKind;
use les::engine::Session;
use les::model::ExpertMode;
use les::store::FileSource;

#[test]
fn no_adapter_is_a_clear_error_and_auto_falls_back_to_cpu() {
    let absent = if cfg!(target_os = "windows") { "metal" } else { "dx12" };
    if std::env::var("WGPU_BACKEND").ok().as_deref() != Some(absent) {
        return crate::common::rerun_with_env(module_path!(), "no_adapter_is_a_clear_error_and_auto_falls_back_to_cpu", &[("WGPU_BACKEND", absent)]);
    }
    let err = les::backend::wgpu::GpuContext::new().err().expect("no adapter for a backend this OS lacks");
    let msg = err.to_string();
    assert!(msg.contains("no GPU adapter") && msg.contains("--backend cpu"), "{msg}");
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/rand-olmoe.gguf");
    let src = FileSource::open(&path).unwrap();
    let mut s = Session::load(&src, ExpertMode::Resident, 64).unwrap();
    assert!(s.set_backend(BackendKind::Wgpu, &GpuOptions::default()).is_err());
    let line = s.set_backend(BackendKind::Auto, &GpuOptions::default()).unwrap();
    assert!(line.starts_with("backend: cpu"), "{line}");
    assert!(s.gpu.is_none());
    let toks = s.tokenize("Hello");
    assert_eq!(s.prefill(&toks).unwrap().len(), s.model.cfg.n_vocab);
}
