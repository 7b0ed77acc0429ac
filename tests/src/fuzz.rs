//! What the fuzz targets check (`tests/fuzz/`, run with `cargo +nightly fuzz run --fuzz-dir
//! tests/fuzz TARGET`), shared with the stable smoke run in `tests/tests/fuzz_smoke.rs` that CI
//! runs over the kept corpus and seeded random inputs. Each function panics when the property
//! it names is broken; anything else it is given is fine.

use cachealloc_core::{Allocator, AllocatorConfig, Config, Expandable, FenceMode, SimDevice};

/// The configuration parser: never panics; a configuration it accepts prints (`to_conf_string`)
/// as text it accepts again, to the same allocator settings.
pub fn config(text: &str) {
    let Ok(config) = Config::parse(text, "fuzz") else {
        return;
    };
    let printed = config.allocator.to_conf_string();
    let again = Config::parse(&printed, "printed")
        .unwrap_or_else(|e| panic!("{text:?} printed as {printed:?}, which fails: {e}"));
    assert_eq!(
        again.allocator, config.allocator,
        "{text:?} printed as {printed:?}, which means something else"
    );
}

/// The trace reader on arbitrary bytes: never panics; what it reads ends at the first tear.
pub fn trace_file(bytes: &[u8]) {
    let path = std::path::Path::new("fuzz/trace-000000.cat");
    if let Ok((records, _tear)) = cachealloc_recorder::reader::read_file(path, bytes) {
        for record in &records {
            // Every record read encodes again (the reader made a well-formed value).
            let mut out = Vec::new();
            record.encode(&mut out);
        }
    }
}

/// The allocator core under an arbitrary operation sequence (2 bytes per operation) on a
/// simulated device whose fences complete only when told: the invariants hold after every
/// operation, live blocks never overlap, and a free of a live block always succeeds. With
/// expandable segments (the first byte's second bit; its third keeps the synchronous API's
/// requests in fixed segments), live blocks also never share memory (moved memory is mapped at
/// several places) and always have memory behind them.
pub fn allocator_ops(bytes: &[u8]) {
    let expandable = bytes.first().is_some_and(|b| b & 2 == 2);
    let mode = match bytes.first() {
        Some(b) if b & 2 == 2 && b & 4 == 4 => Expandable::StreamOrdered,
        Some(b) if b & 2 == 2 => Expandable::On,
        _ => Expandable::Off,
    };
    let mut device = SimDevice::with_fence_mode(512 << 20, FenceMode::Manual);
    if expandable {
        device = device.with_map_granularity(2 << 20);
    }
    let config = AllocatorConfig {
        max_split_size: if bytes.first().is_some_and(|b| b & 1 == 1) {
            64 << 20
        } else {
            u64::MAX
        },
        expandable_segments: mode,
        ..AllocatorConfig::default()
    };
    let alloc = Allocator::new(device, config);
    let mut live: Vec<(u64, u64)> = Vec::new();
    // The memory behind each live block: (memory, start, end) pieces.
    let mut memory: Vec<(u64, u64, u64)> = Vec::new();
    for op in bytes.chunks_exact(2) {
        let (kind, arg) = (op[0] % 8, op[1]);
        match kind {
            0..=3 => {
                // Sizes from 1 B to 96 MiB, log-spread.
                let size = (1u64 << (arg % 27)) + u64::from(arg) * 37;
                let stream = u64::from(op[0] / 8 % 3);
                let mut changes = cachealloc_core::SegmentChanges::default();
                if let Ok(a) = alloc.malloc_on_stream(size, stream, 0, &mut changes) {
                    assert!(a.size >= size, "a block smaller than its request");
                    for &(addr, len) in &live {
                        assert!(
                            a.address + a.size <= addr || addr + len <= a.address,
                            "live blocks overlap: {:#x}+{} and {addr:#x}+{len}",
                            a.address,
                            a.size
                        );
                    }
                    live.push((a.address, a.size));
                    if expandable {
                        let pieces = (alloc.device().memory_of(a.address, a.size))
                            .unwrap_or_else(|| panic!("no memory behind {:#x}", a.address));
                        for &(m, start, end) in &pieces {
                            assert!(
                                memory
                                    .iter()
                                    .all(|&(n, s, e)| n != m || end <= s || e <= start),
                                "{:#x} shares memory {m} with a live block",
                                a.address
                            );
                        }
                        memory.extend(pieces);
                    }
                }
            }
            4 | 5 if !live.is_empty() => {
                let (address, size) = live.swap_remove(usize::from(arg) % live.len());
                if expandable {
                    let pieces = alloc.device().memory_of(address, size).expect("backed");
                    memory.retain(|piece| !pieces.contains(piece));
                }
                let stream = u64::from(op[0] / 8 % 3);
                alloc
                    .free_on_stream(address, stream)
                    .unwrap_or_else(|e| panic!("freeing a live block failed: {e}"));
            }
            6 => alloc.device().complete_fences(),
            7 if arg % 4 == 0 => {
                let _ = alloc.empty_cache();
            }
            _ => {}
        }
        alloc
            .check_invariants()
            .unwrap_or_else(|e| panic!("invariants broken: {e}"));
        if let Some(&(address, size)) = live.iter().find(|&&(a, n)| !alloc.device().is_backed(a, n))
        {
            panic!("live block {address:#x}+{size} lost its memory");
        }
    }
}
