//! What each interposed call does, in safe Rust: pool it or pass it through. [`crate::ffi`]
//! converts the C arguments and calls these; [`crate::process`] holds the state.
//!
//! | module | hooks of |
//! |---|---|
//! | [`runtime`] | the runtime's functions (`cudaMalloc` …) and the C API's allocation pair |
//! | [`driver`] | the driver's functions (`cuMemAlloc_v2` …), whichever door they came through |

pub mod driver;
pub mod runtime;
