//! The allocator core's operation sequences: see `cachealloc_tests::fuzz::allocator_ops`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cachealloc_tests::fuzz::allocator_ops(data));
