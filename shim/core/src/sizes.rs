//! Size classes: how a request is rounded, which pool serves it, how big a new segment is, and
//! when a free block is split. Each rule is a small pure function.
//!
//! # Note [Size classes, split and merge]
//!
//! These are PyTorch's CUDACachingAllocator rules (constants `kMinBlockSize`, `kSmallSize`,
//! `kSmallBuffer`, `kMinLargeAlloc`, `kRoundLarge`, `kLargeBuffer`); we keep them exactly so that
//! a trace replayed by `cachealloc simulate` behaves like the allocator PyTorch users know.
//!
//! * **Rounding** ([`round_size`]). Every request is rounded up to a multiple of 512 B
//!   (a zero-byte request takes 512 B, as in PyTorch). Worst-case waste: 511 B per block.
//!   With `roundup_power2_divisions:N` a request above `512·N` B is rounded to the next of `N`
//!   equal steps between two powers of two (for N = 4: 1024, 1280, 1536, 1792, 2048, …).
//!   Worst-case waste: just under `1/N` of the power of two below the request (25 % for N = 4);
//!   the gain is that slightly different sizes land on the same block size and reuse each
//!   other's blocks. The per-interval form `[256:1,512:2,>:8]` picks `N` by the power-of-two
//!   interval of the request (keys are MiB).
//! * **Pools** ([`pool_for`]). Requests of at most 1 MiB go to the *small* pool, the rest to the
//!   *large* pool. Blocks never move between pools, so small churn cannot fragment large
//!   segments.
//! * **Segment size** ([`segment_size`]). The small pool grows by 2 MiB segments, packing up to
//!   4096 small blocks into one device allocation. Large requests under 10 MiB take a 20 MiB
//!   segment (room to be split for the next few); larger requests get a segment of their own,
//!   rounded to 2 MiB. Worst case: a lone 1 MiB + 512 B request reserves 20 MiB until other
//!   requests share its segment or the cache is emptied; a 10 MiB + 512 B request reserves
//!   12 MiB (2 MiB − 512 B of rounding).
//! * **Splitting** ([`should_split`]). A block bigger than the request is split and the rest
//!   stays free, unless the rest is too small to be worth tracking: in the small pool the rest
//!   must be at least 512 B; in the large pool more than 1 MiB (a smaller tail would only serve
//!   small requests, which use the other pool). So a large block can carry up to 1 MiB of
//!   unusable tail — the *internal fragmentation* bound of the large pool.
//! * **`max_split_size`**. Blocks of at least this size are never split: requests below it never
//!   take such a block ([`fits`]), which keeps huge cached blocks from being nibbled into
//!   unusable pieces. A request of at least `max_split_size` takes an oversize block only if the
//!   block is less than [`OVERSIZE_SLACK`] bigger than the request. PyTorch's source comment
//!   says "within 1MB", but its code compares with `kLargeBuffer` (20 MiB); we follow the code,
//!   since `simulate` must predict what PyTorch and the shim actually do. Worst-case waste:
//!   just under 20 MiB per oversize block.
//! * **Merging** (in [`crate::pools`]). A block becoming free merges with free neighbours of the
//!   same segment; blocks never merge across segments, since each segment is one device
//!   allocation and is released whole.
//!
//! Best fit: a free block is chosen by the smallest `(size, address)` at least as large as the
//! rounded request, so ties go to the lowest address, packing live data low in each segment.

/// Minimum block size and rounding granularity (PyTorch `kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Largest request served from the small pool (PyTorch `kSmallSize`).
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool (PyTorch `kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for large requests below [`MIN_LARGE_ALLOC`] (PyTorch `kLargeBuffer`).
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests at least this big get a segment of their own (PyTorch `kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of segments of their own (PyTorch `kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 << 20;
/// How much bigger than the request an oversize block may be and still serve it (PyTorch
/// compares with `kLargeBuffer`; see the note above).
pub const OVERSIZE_SLACK: u64 = LARGE_BUFFER;

/// The two block pools of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// Requests of at most [`SMALL_SIZE`], carved from [`SMALL_BUFFER`] segments.
    Small,
    /// Everything else.
    Large,
}

impl PoolKind {
    /// The name PyTorch uses in stats keys and snapshots (`small_pool`, `large_pool`).
    pub fn stat_name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }

    /// The `segment_type` of a PyTorch snapshot (`small`, `large`).
    pub fn segment_type(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// How `roundup_power2_divisions` applies: not at all, one value for every size, or one value
/// per power-of-two interval.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Roundup {
    /// Plain 512 B rounding.
    #[default]
    None,
    /// The same number of divisions for every size.
    Uniform(u32),
    /// Divisions per power-of-two interval: `per_interval[i]` applies to requests in
    /// `[2^i MiB, 2^(i+1) MiB)` for i ≥ 1, index 0 to everything below 2 MiB; the last entry
    /// applies to everything larger.
    PerInterval(Vec<u32>),
}

impl Roundup {
    /// Number of divisions for a request of `size` bytes (0 or 1 = plain rounding).
    pub fn divisions_for(&self, size: u64) -> u32 {
        match self {
            Roundup::None => 0,
            Roundup::Uniform(n) => *n,
            Roundup::PerInterval(table) => {
                if table.is_empty() {
                    return 0;
                }
                let mib = size >> 20;
                let index = if mib == 0 {
                    0
                } else {
                    (63 - mib.leading_zeros()) as usize
                };
                table[index.min(table.len() - 1)]
            }
        }
    }
}

/// Round a request up to its block size (see the note above). Never returns less than
/// [`MIN_BLOCK_SIZE`]; saturates near `u64::MAX` (such a request fails later as too big).
pub fn round_size(size: u64, roundup: &Roundup) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let divisions = u64::from(roundup.divisions_for(size));
    if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
        round_power2_divisions(size, divisions)
    } else {
        round_up(size, MIN_BLOCK_SIZE)
    }
}

/// Round `size` up to the next of `divisions` equal steps between the powers of two around it.
fn round_power2_divisions(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = (floor / divisions).max(1);
    let rounded_down = size & !(step - 1);
    if rounded_down == size {
        size
    } else {
        rounded_down.saturating_add(step)
    }
}

/// Round `value` up to a multiple of `granule` (a power of two), saturating.
pub fn round_up(value: u64, granule: u64) -> u64 {
    debug_assert!(granule.is_power_of_two());
    match value.checked_add(granule - 1) {
        Some(v) => v & !(granule - 1),
        None => !(granule - 1),
    }
}

/// The bytes a memory limit of `fraction` of a device of `total` bytes allows: the product
/// rounded to the nearest byte. PyTorch truncates it, which loses a byte for about one value in
/// ten when the fraction was computed as `bytes / total` (PyTorch's limited-memory tests set
/// `(memory_reserved() + 40 MiB) / total` and then allocate 40 MiB exactly); rounding gives
/// `bytes` back exactly, as the program meant.
pub fn limit_for_fraction(total: u64, fraction: f64) -> u64 {
    (total as f64 * fraction).round() as u64
}

/// The pool that serves a rounded request.
pub fn pool_for(rounded: u64) -> PoolKind {
    if rounded <= SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// Size of the device allocation made when no cached block can serve a rounded request.
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}

/// Whether a free block of `block_size` may serve a rounded request of `rounded` bytes under
/// the `max_split_size` rules (the size order is checked by the caller's best-fit search).
pub fn fits(block_size: u64, rounded: u64, max_split_size: u64) -> bool {
    if rounded < max_split_size {
        block_size < max_split_size
    } else {
        block_size < rounded.saturating_add(OVERSIZE_SLACK)
    }
}

/// Whether serving `rounded` from a free block of `block_size` should split off the rest.
pub fn should_split(pool: PoolKind, block_size: u64, rounded: u64, max_split_size: u64) -> bool {
    let rest = block_size - rounded;
    match pool {
        PoolKind::Small => rest >= MIN_BLOCK_SIZE,
        PoolKind::Large => rounded < max_split_size && rest > SMALL_SIZE,
    }
}

/// Whether a block is oversize (counted in `oversize_*` stats, never split).
pub fn is_oversize(size: u64, max_split_size: u64) -> bool {
    size >= max_split_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_computed_from_bytes_allows_those_bytes_exactly() {
        // 58 MiB of a 100 MiB device: the truncated product is one byte short.
        let (total, bytes) = (100u64 << 20, 58u64 << 20);
        let fraction = bytes as f64 / total as f64;
        assert_eq!(
            (total as f64 * fraction) as u64,
            bytes - 1,
            "the case truncation loses"
        );
        assert_eq!(limit_for_fraction(total, fraction), bytes);
        // Every 2 MiB step of an H200-sized device.
        let total = 150_110_011_392u64;
        for bytes in (1..2000u64).map(|k| k << 21) {
            assert_eq!(
                limit_for_fraction(total, bytes as f64 / total as f64),
                bytes
            );
        }
        assert_eq!(limit_for_fraction(total, 1.0), total);
        assert_eq!(limit_for_fraction(total, 0.0), 0);
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn zero_and_tiny_requests_take_one_min_block() {
        assert_eq!(round_size(0, &Roundup::None), 512);
        assert_eq!(round_size(1, &Roundup::None), 512);
        assert_eq!(round_size(512, &Roundup::None), 512);
        assert_eq!(round_size(513, &Roundup::None), 1024);
    }

    #[test]
    fn power2_divisions_round_to_steps() {
        let r = Roundup::Uniform(4);
        // Below 512·4 = 2048 B the plain rule applies.
        assert_eq!(round_size(1500, &r), 1536);
        assert_eq!(round_size(2049, &r), 2560);
        assert_eq!(round_size(2560, &r), 2560);
        assert_eq!(round_size(4096, &r), 4096);
        assert_eq!(round_size(5 * MIB + 1, &r), 6 * MIB);
        assert_eq!(round_size(1200 * 1024, &r), 1280 * 1024);
        // One division means plain rounding.
        assert_eq!(round_size(5 * MIB + 1, &Roundup::Uniform(1)), 5 * MIB + 512);
    }

    #[test]
    fn per_interval_divisions_pick_by_power_of_two() {
        // index 0: < 2 MiB, 1: [2,4), 2: [4,8) ...
        let r = Roundup::PerInterval(vec![1, 1, 2, 8]);
        assert_eq!(r.divisions_for(100), 1);
        assert_eq!(r.divisions_for(3 * MIB), 1);
        assert_eq!(r.divisions_for(5 * MIB), 2);
        assert_eq!(r.divisions_for(9 * MIB), 8);
        assert_eq!(r.divisions_for(1 << 40), 8);
        assert_eq!(round_size(5 * MIB, &r), 6 * MIB);
        assert_eq!(round_size(5 * MIB + 7, &r), 6 * MIB);
    }

    #[test]
    fn rounding_saturates_instead_of_overflowing() {
        assert!(round_size(u64::MAX, &Roundup::None) >= u64::MAX - 511);
        assert!(round_size(u64::MAX - 3, &Roundup::Uniform(8)) > 0);
    }

    #[test]
    fn pool_boundary_is_exactly_one_mib() {
        assert_eq!(pool_for(MIB), PoolKind::Small);
        assert_eq!(pool_for(MIB + 512), PoolKind::Large);
    }

    #[test]
    fn segment_sizes_by_request() {
        assert_eq!(segment_size(512), 2 * MIB);
        assert_eq!(segment_size(MIB), 2 * MIB);
        assert_eq!(segment_size(MIB + 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB - 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB), 10 * MIB);
        assert_eq!(segment_size(10 * MIB + 512), 12 * MIB);
    }

    #[test]
    fn split_rules_per_pool() {
        let no_limit = u64::MAX;
        assert!(should_split(
            PoolKind::Small,
            2 * MIB,
            2 * MIB - 512,
            no_limit
        ));
        assert!(!should_split(PoolKind::Small, 1024, 1024, no_limit));
        // Large: the rest must exceed 1 MiB.
        assert!(!should_split(PoolKind::Large, 3 * MIB, 2 * MIB, no_limit));
        assert!(should_split(
            PoolKind::Large,
            3 * MIB + 512,
            2 * MIB,
            no_limit
        ));
        // Requests at or above max_split_size never split.
        assert!(!should_split(PoolKind::Large, 40 * MIB, 8 * MIB, 8 * MIB));
        assert!(should_split(
            PoolKind::Large,
            40 * MIB,
            8 * MIB - 512,
            8 * MIB
        ));
    }

    #[test]
    fn oversize_blocks_serve_only_close_requests() {
        let max_split = 8 * MIB;
        // A request below max_split never takes an oversize block.
        assert!(!fits(8 * MIB, 4 * MIB, max_split));
        assert!(fits(8 * MIB - 512, 4 * MIB, max_split));
        // An oversize request takes a block less than 20 MiB bigger.
        assert!(fits(8 * MIB + 20 * MIB - 512, 8 * MIB, max_split));
        assert!(!fits(8 * MIB + 20 * MIB, 8 * MIB, max_split));
        assert!(is_oversize(8 * MIB, max_split));
        assert!(!is_oversize(8 * MIB - 1, max_split));
    }
}
