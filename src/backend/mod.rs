//! Compute backends. `cpu` is the reference (and the fast native path); a wgpu backend follows
//! the same op set (see NOTES.md).

pub mod cpu;
