//! The trace reader: see `cachealloc_tests::fuzz::trace_file`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cachealloc_tests::fuzz::trace_file(data));
