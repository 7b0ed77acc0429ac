//! [`OomReport`]: everything known about a request that could not be served, and how it is
//! printed; [`format_bytes`]. The allocator fills it in at the last rung of its ladder (see
//! [Note [The allocation ladder and the lock]](crate::allocator#note-the-allocation-ladder-and-the-lock));
//! [`Event::Oom`](crate::events::Event::Oom) carries it to the observer.

use std::fmt;

use crate::sizes::PoolKind;

/// Everything known about a request that could not be served, for the stderr paragraph, the
/// trace's `oom` record and the tools.
#[derive(Clone, Debug, PartialEq)]
pub struct OomReport {
    /// The application's request.
    pub requested: u64,
    /// The request after rounding.
    pub rounded: u64,
    /// The pool it would come from.
    pub pool: PoolKind,
    /// Size of the segment that was asked of the device (with expandable segments: the
    /// request's size in whole granules, the most a map for it needs).
    pub segment_size: u64,
    /// Bytes handed to the application.
    pub allocated: u64,
    /// Bytes held from the device.
    pub reserved: u64,
    /// Reserved bytes in free blocks (cached, not allocated).
    pub cached_free: u64,
    /// The largest free block.
    pub largest_free_block: u64,
    /// Share of cached free memory outside the largest free block (0 = one free block,
    /// near 1 = scattered in small pieces).
    pub fragmentation: f64,
    /// What the device reports as free.
    pub device_free: u64,
    /// The device's total memory.
    pub device_total: u64,
    /// The process's memory limit (`per_process_memory_fraction` × total), or the limit all
    /// the device's pools share when that is lower ([`crate::Device::shared_limit`]).
    pub limit: u64,
    /// What the device's other pools (graph pools, `MemPool`s) hold against a shared limit.
    pub held_elsewhere: u64,
    /// The request's tag (the recorder's stack id).
    pub tag: u64,
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = |b: u64| format_bytes(b);
        write!(
            f,
            "out of memory: tried to allocate {} (rounded to {} in the {} pool, needing a {} segment). \
             The device has {} in total, of which {} is free; this process may reserve {}{}. \
             cachealloc holds {} reserved, {} of it allocated to the application and {} cached free; \
             the largest free block is {} (fragmentation {:.0}%).",
            g(self.requested),
            g(self.rounded),
            self.pool.segment_type(),
            g(self.segment_size),
            g(self.device_total),
            g(self.device_free),
            g(self.limit),
            if self.held_elsewhere > 0 {
                format!(
                    ", of which its other pools (graphs, MemPools) hold {}",
                    g(self.held_elsewhere)
                )
            } else {
                String::new()
            },
            g(self.reserved),
            g(self.allocated),
            g(self.cached_free),
            g(self.largest_free_block),
            self.fragmentation * 100.0,
        )?;
        if self.cached_free >= self.rounded {
            write!(
                f,
                " Enough memory is cached but no free block is big enough: fragmentation; \
                 try max_split_size_mb or expandable_segments."
            )?;
        }
        Ok(())
    }
}

/// Bytes in binary units, as the reports print them.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}
