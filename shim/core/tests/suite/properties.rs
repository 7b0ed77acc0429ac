//! Property tests: random sequences of malloc / free / empty_cache / fence events over many
//! configs, with `check_invariants()` after every step and a naive model alongside that knows
//! which bytes are live and which freed bytes are still unsafe to reuse.
//!
//! The model's reuse rule: a block freed when `k` fences had been recorded may be handed out
//! again only once a fence numbered above `k` has completed — except that a block freed on its
//! own stream (`reuse:auto`) may be handed out at once to a request on that stream, and never
//! to another stream's. Requests come on [`NO_STREAM`] and on two streams.

use cachealloc_core::sizes::PoolKind;
use cachealloc_core::sizes::Roundup;
use cachealloc_core::{
    AllocError, AllocatorConfig, BlockState, Expandable, NO_STREAM, ReusePolicy,
};
use proptest::prelude::*;

use crate::common::{Checked, GRANULARITY, MIB};

/// The streams requests and frees come on.
const STREAMS: [u64; 3] = [NO_STREAM, 0x11, 0x22];

#[derive(Clone, Debug)]
enum Op {
    /// Allocate this many bytes on `STREAMS[i % 3]`.
    Malloc(u64, usize),
    /// Free the live allocation at this index (modulo the number live): synchronously, on its
    /// own stream, or on another.
    Free(usize, FreeOn),
    EmptyCache,
    /// The GPU catches up: every fence recorded so far completes.
    CompleteFences,
    /// The app creates its first stream (auto policy switches to fencing).
    StreamCreated,
    FlushFences,
    /// The program switches expandable segments on or off at run time.
    SetExpandable(Expandable),
    /// Free the live allocation at this index as [`Op::Free`] does, but held back from reuse
    /// (work on other streams may still use it: `record_stream`).
    FreeHeld(usize, FreeOn),
    /// The work that held the held block at this index (modulo the number held) is done.
    ReleaseHeld(usize),
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..4096,
        4 => 4096u64..(MIB + 4096),
        3 => MIB..12 * MIB,
        1 => 12 * MIB..80 * MIB,
        1 => Just(MIB),
        1 => Just(10 * MIB),
    ]
}

#[derive(Clone, Copy, Debug)]
enum FreeOn {
    Sync,
    OwnStream,
    OtherStream,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let free_on = prop_oneof![
        Just(FreeOn::Sync),
        Just(FreeOn::OwnStream),
        Just(FreeOn::OtherStream)
    ];
    prop_oneof![
        10 => (size_strategy(), 0usize..3).prop_map(|(size, s)| Op::Malloc(size, s)),
        8 => (any::<usize>(), free_on.clone()).prop_map(|(i, on)| Op::Free(i, on)),
        1 => Just(Op::EmptyCache),
        3 => Just(Op::CompleteFences),
        1 => Just(Op::StreamCreated),
        1 => Just(Op::FlushFences),
        1 => prop_oneof![
            Just(Expandable::Off),
            Just(Expandable::StreamOrdered),
            Just(Expandable::On)
        ]
        .prop_map(Op::SetExpandable),
        2 => (any::<usize>(), free_on).prop_map(|(i, on)| Op::FreeHeld(i, on)),
        2 => any::<usize>().prop_map(Op::ReleaseHeld),
    ]
}

fn config_strategy() -> impl Strategy<Value = AllocatorConfig> {
    (
        prop_oneof![Just(u64::MAX), Just(24 * MIB), Just(40 * MIB)],
        prop_oneof![
            Just(Roundup::None),
            Just(Roundup::Uniform(2)),
            Just(Roundup::Uniform(8)),
            Just(Roundup::PerInterval(vec![1, 4, 2, 8]))
        ],
        prop_oneof![Just(0.0), Just(0.5), Just(0.8)],
        (prop_oneof![Just(1.0), Just(0.6)], any::<bool>()),
        prop_oneof![
            Just(ReusePolicy::Auto),
            Just(ReusePolicy::Fenced),
            Just(ReusePolicy::Immediate)
        ],
        prop_oneof![
            Just(Expandable::Off),
            Just(Expandable::StreamOrdered),
            Just(Expandable::On)
        ],
    )
        .prop_map(
            |(
                max_split_size,
                roundup,
                gc,
                (fraction, counts_synchronous),
                reuse,
                expandable_segments,
            )| AllocatorConfig {
                max_split_size,
                roundup,
                garbage_collection_threshold: gc,
                per_process_memory_fraction: fraction,
                fraction_counts_synchronous: counts_synchronous,
                expandable_segments,
                reuse,
            },
        )
}

struct LiveBlock {
    address: u64,
    size: u64,
    requested: u64,
    stream: u64,
}

/// Bytes freed but possibly still in use by the GPU: (address, size, fences recorded at free),
/// and the stream that may reuse them (ordered after the free), if any: at once for a free on
/// that stream, or after a device-side wait (`stream_waits` above `waits_at_free`) for a free
/// on another stream.
struct Unsafe {
    address: u64,
    size: u64,
    fences_at_free: u64,
    safe_for: Option<u64>,
    waits_at_free: Option<u64>,
}

/// The stream a free of `b` is ordered on.
fn free_stream(b: &LiveBlock, on: FreeOn) -> u64 {
    match on {
        FreeOn::Sync => NO_STREAM,
        FreeOn::OwnStream => b.stream,
        FreeOn::OtherStream => *STREAMS
            .iter()
            .find(|&&s| s != b.stream && s != NO_STREAM)
            .unwrap(),
    }
}

fn overlaps(a: u64, a_size: u64, b: u64, b_size: u64) -> bool {
    a < b + b_size && b < a + a_size
}

/// The least memory a request must map in the expandable segments of its stream and pool:
/// the granules (pools that keep their maps: PyTorch's pages) it needs beyond the free block
/// before an unmapped one.
fn least_to_map(c: &Checked, rounded: u64, pool: PoolKind, stream: u64, kept: bool) -> u64 {
    let step = match pool {
        PoolKind::Large if kept => 20 * MIB,
        _ => GRANULARITY,
    };
    let mut least = rounded.div_ceil(step).max(1) * step;
    for seg in c.alloc.snapshot() {
        if !seg.expandable || seg.pool != pool || seg.stream != stream {
            continue;
        }
        for (i, b) in seg.blocks.iter().enumerate() {
            if b.state != BlockState::Unmapped {
                continue;
            }
            let before = match i.checked_sub(1).map(|j| &seg.blocks[j]) {
                Some(prev) if prev.state == BlockState::Free => prev.size,
                _ => 0,
            };
            let need = rounded.saturating_sub(before).div_ceil(step).max(1) * step;
            if need <= b.size {
                least = least.min(need);
            }
        }
    }
    least
}

/// The model's side of `b`'s free on `stream` (`pending`: behind a fence): which bytes are
/// unsafe to hand out, to whom, until when.
fn freed_model(
    c: &Checked,
    b: &LiveBlock,
    stream: u64,
    pending: bool,
    auto: bool,
    fencing: bool,
    unsafe_ranges: &mut Vec<Unsafe>,
) {
    let streams = auto && stream != NO_STREAM && b.stream != NO_STREAM;
    let stream_ordered = streams && stream == b.stream;
    let cross = streams && stream != b.stream;
    if fencing || stream_ordered {
        // Unsafe for every other stream until a later fence completes; a stream's own blocks
        // are never handed to another stream anyway.
        let k = c.device().fences_recorded();
        unsafe_ranges.push(Unsafe {
            address: b.address,
            size: b.size,
            fences_at_free: if pending { k } else { u64::MAX },
            safe_for: (!pending || cross).then_some(b.stream),
            waits_at_free: (pending && cross).then(|| c.device().counters().stream_waits),
        });
    }
}

/// `kept`: the pools keep their maps (a private pool's; Note [Kept maps]): nothing is unmapped
/// or moved then but by `empty_cache`.
fn run(
    config: AllocatorConfig,
    capacity: u64,
    ops: Vec<Op>,
    kept: bool,
) -> Result<(), TestCaseError> {
    let fenced_from_start = config.reuse == ReusePolicy::Fenced;
    let auto = config.reuse == ReusePolicy::Auto;
    let immediate = config.reuse == ReusePolicy::Immediate;
    let config_mode = config.expandable_segments;
    // A pool that keeps its maps is a private pool, which serves no synchronous request in the
    // shim; under PyTorch's fraction such a request is refused by the device rather than the
    // limit, and a map run rolled back unmaps what it made, which this check could not tell
    // from kept maps given back.
    let config = AllocatorConfig {
        fraction_counts_synchronous: config.fraction_counts_synchronous || kept,
        ..config
    };
    let c = Checked::manual(capacity, config);
    if kept {
        c.alloc.keep_maps();
    }
    let mut given_back = (0, 0);
    // Whether growth maps into expandable segments now (the program may switch).
    let mut grows_expandable = c.alloc.expandable();
    // Whether the synchronous API's requests keep fixed segments meanwhile.
    let mut synchronous_fixed = config_mode == Expandable::StreamOrdered;
    let mut live: Vec<LiveBlock> = Vec::new();
    // Blocks freed but held back (free_held), with the stream each was freed on.
    let mut held: Vec<(LiveBlock, u64)> = Vec::new();
    let mut unsafe_ranges: Vec<Unsafe> = Vec::new();
    let mut fencing = fenced_from_start;
    for op in ops {
        let empties = matches!(op, Op::EmptyCache);
        match op {
            Op::Malloc(size, s) => match c.try_malloc_on(size, STREAMS[s % STREAMS.len()]) {
                Ok(a) => {
                    let stream = STREAMS[s % STREAMS.len()];
                    prop_assert!(a.size >= size && a.size % 512 == 0);
                    prop_assert_eq!(a.stream, stream);
                    for l in live.iter().chain(held.iter().map(|(b, _)| b)) {
                        prop_assert!(
                            !overlaps(a.address, a.size, l.address, l.size),
                            "overlaps a live or held block"
                        );
                    }
                    let done = c.device().completed_through();
                    unsafe_ranges.retain(|u| u.fences_at_free >= done);
                    let stream_waits = c.device().counters().stream_waits;
                    let ordered = |u: &Unsafe| {
                        u.safe_for == Some(stream)
                            && u.waits_at_free.is_none_or(|w| stream_waits > w)
                    };
                    for u in unsafe_ranges.iter().filter(|u| !ordered(u)) {
                        prop_assert!(
                            !overlaps(a.address, a.size, u.address, u.size),
                            "reused {:#x} before a fence after its free completed",
                            u.address
                        );
                    }
                    // Bytes once handed to this stream never go to another stream's requests.
                    unsafe_ranges.retain(|u| {
                        !(u.safe_for == Some(stream)
                            && overlaps(a.address, a.size, u.address, u.size))
                    });
                    live.push(LiveBlock {
                        address: a.address,
                        size: a.size,
                        requested: size,
                        stream,
                    });
                }
                Err(AllocError::OutOfMemory(report)) => {
                    // Fails only if the request cannot fit: even with every free segment
                    // released, the device or the limit has no room for the new segment —
                    // with expandable segments, for the granules the request still needs
                    // beyond the free memory before the best unmapped place.
                    let stream = STREAMS[s % STREAMS.len()];
                    let needed = if grows_expandable && !(synchronous_fixed && stream == NO_STREAM)
                    {
                        let needed = least_to_map(&c, report.rounded, report.pool, stream, kept);
                        prop_assert!(needed <= report.segment_size);
                        needed
                    } else {
                        report.segment_size
                    };
                    let over_limit = report.reserved + needed > report.limit;
                    let device_full = report.device_free < needed;
                    prop_assert!(over_limit || device_full, "spurious OOM: {}", report);
                }
                Err(e) => return Err(TestCaseError::fail(format!("device error {e}"))),
            },
            Op::Free(i, on) if !live.is_empty() => {
                let b = live.swap_remove(i % live.len());
                let stream = free_stream(&b, on);
                let f = c.free_on(b.address, stream);
                prop_assert_eq!(f.size, b.size);
                let expect_pending =
                    fencing && !(auto && stream != NO_STREAM && stream == b.stream);
                prop_assert_eq!(f.pending, expect_pending);
                freed_model(&c, &b, stream, f.pending, auto, fencing, &mut unsafe_ranges);
            }
            Op::FreeHeld(i, on) if !live.is_empty() => {
                let b = live.swap_remove(i % live.len());
                let stream = free_stream(&b, on);
                let f = c.alloc.free_held(b.address, stream).unwrap();
                c.check();
                prop_assert_eq!((f.size, f.pending), (b.size, true));
                prop_assert!(c.alloc.free_held(b.address, stream).is_err(), "freed twice");
                held.push((b, stream));
            }
            Op::ReleaseHeld(i) if !held.is_empty() => {
                let (b, stream) = held.swap_remove(i % held.len());
                let active = c.stats().active_bytes.all.current;
                prop_assert!(c.alloc.release_held(b.address));
                c.check();
                prop_assert!(!c.alloc.release_held(b.address), "released twice");
                // Where its free would have sent it now: free at once, or behind a fence.
                let pending = fencing && !(auto && stream != NO_STREAM && stream == b.stream);
                let released = (active - c.stats().active_bytes.all.current) as u64;
                prop_assert_eq!(released, if pending { 0 } else { b.size });
                freed_model(&c, &b, stream, pending, auto, fencing, &mut unsafe_ranges);
            }
            Op::FreeHeld(..) | Op::ReleaseHeld(..) => {}
            Op::Free(..) => {}
            Op::EmptyCache => c.empty_cache(),
            Op::CompleteFences => c.device().complete_fences(),
            Op::StreamCreated => {
                let before = c.device().fences_recorded();
                c.alloc.start_fencing().unwrap();
                c.check();
                if !immediate && !fencing {
                    fencing = true;
                }
                let after = c.device().fences_recorded();
                if after > before {
                    // Every free-list block is behind the gate fence just recorded.
                    let gate = after - 1;
                    for seg in c.alloc.snapshot() {
                        for b in seg
                            .blocks
                            .iter()
                            .filter(|b| b.state == cachealloc_core::BlockState::Free)
                        {
                            // Only NO_STREAM's lists are gated: a stream's free blocks were
                            // freed in its order and stay safe for it.
                            if seg.stream == NO_STREAM {
                                unsafe_ranges.push(Unsafe {
                                    address: b.address,
                                    size: b.size,
                                    fences_at_free: gate,
                                    safe_for: None,
                                    waits_at_free: None,
                                });
                            }
                        }
                    }
                }
            }
            Op::FlushFences => {
                c.alloc.flush_fences().unwrap();
                c.check();
            }
            Op::SetExpandable(mode) => {
                grows_expandable = c.alloc.set_expandable(mode);
                synchronous_fixed = mode == Expandable::StreamOrdered;
                prop_assert_eq!(grows_expandable, mode.any(), "the simulated device maps");
                c.check();
            }
        }
        // Differential check against the model.
        let s = c.stats();
        prop_assert_eq!(
            s.allocated_bytes.all.current as u64,
            live.iter().map(|l| l.size).sum::<u64>()
        );
        prop_assert_eq!(s.allocation.all.current as usize, live.len());
        // Held blocks are no longer allocated, but still active.
        prop_assert!(
            s.active_bytes.all.current as u64
                >= live
                    .iter()
                    .chain(held.iter().map(|(b, _)| b))
                    .map(|l| l.size)
                    .sum::<u64>()
        );
        prop_assert!(
            s.requested_bytes.all.current as u64 >= live.iter().map(|l| l.requested).sum::<u64>()
        );
        prop_assert_eq!(s.reserved_bytes.all.current as u64, c.device().used());
        // The limit counts what its scope says: everything, or PyTorch's stream-ordered memory.
        let counted = if c.alloc.config().fraction_counts_synchronous {
            s.reserved_bytes.all.current
        } else {
            s.stream_ordered_view().reserved_bytes.all.current
        };
        prop_assert!(counted as u64 <= c.alloc.limit());
        // Kept maps: no unmap, and no move, but by empty_cache.
        let counters = c.device().counters();
        let gave_back = (counters.unmaps, counters.aliases);
        prop_assert!(
            !kept || empties || gave_back == given_back,
            "kept maps were given back: unmaps and moves {:?} -> {:?}",
            given_back,
            gave_back
        );
        given_back = gave_back;
    }
    // Everything can be given back.
    for (b, _) in held {
        prop_assert!(c.alloc.release_held(b.address));
    }
    for l in live {
        c.free(l.address);
    }
    c.empty_cache();
    prop_assert_eq!(c.device().used(), 0);
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 2000, ..ProptestConfig::default() })]

    /// The main property: 10 000 random sequences by default.
    #[test]
    fn random_sequences_keep_invariants_and_match_the_model(
        config in config_strategy(),
        capacity in prop_oneof![Just(64 * MIB), Just(256 * MIB), Just(4u64 << 30)],
        ops in prop::collection::vec(op_strategy(), 1..120),
        kept in prop::bool::weighted(0.25),
    ) {
        run(config, capacity, ops, kept)?;
    }
}
