//! The real CUDA functions behind the hooks: what a call passes through to, and what the pools'
//! own segments come from. Side by side:
//!
//! | module | functions | found |
//! |---|---|---|
//! | [`runtime`] | libcudart's (`cudaMalloc` …) | at first use: `dlsym(RTLD_NEXT)`, then the loaded runtime's own handle |
//! | [`driver`] | libcuda's own (`cuMemAlloc_v2` …) | at first use, with the real `dlsym` on our handle of libcuda ([`crate::symbols::libcuda`]) |
//!
//! Nothing here can return one of our own wrappers; calls the shim makes into the runtime are
//! marked so that the runtime's driver calls come straight back to the driver
//! ([`crate::symbols::through_runtime`]).

pub mod driver;
pub mod runtime;
