//! The configuration parser: see `cachealloc_tests::fuzz::config`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        cachealloc_tests::fuzz::config(text);
    }
});
