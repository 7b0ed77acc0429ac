//! PyTorch's snapshot `segments` read from the library's pools now, not from the trace: what
//! `MemPool.snapshot()` returns, and `torch.cuda.memory_snapshot()` when there is no trace
//! (`trace:off`), under the shim.
//!
//! The shape is PyTorch's (`torch/csrc/cuda/memory_snapshot.cpp`): a segment per fixed segment
//! and, as PyTorch reports its expandable segments, a segment per run of mapped memory in an
//! expandable range (unmapped address space is not shown). The pools keep no stacks, so
//! `frames` are empty; the trace's snapshot has them.

use cachealloc_core::{BlockState, PoolKind, SegmentSnapshot};

use super::Shim;

impl Shim {
    /// The segments of `device`'s pools now — only those of the pool the library keys `only`
    /// (0: the ordinary pool; see [`Shim::segment_snapshots`]) if given — as the JSON list of
    /// PyTorch's snapshot `segments`, each with its blocks tiling it.
    pub fn pool_segments_json(&self, device: i32, only: Option<u64>) -> String {
        let segments: Vec<String> = self
            .segment_snapshots(device)
            .iter()
            .filter(|(id, _)| only.is_none_or(|only| *id == only))
            .flat_map(|(id, segment)| segment_jsons(device, *id, segment))
            .collect();
        format!("[{}]", segments.join(","))
    }
}

/// The snapshot segments of `segment`, in the pool `id` of `device`: one per run of mapped
/// blocks (the whole segment if it is fixed).
fn segment_jsons(device: i32, id: u64, segment: &SegmentSnapshot) -> Vec<String> {
    let segment_type = match segment.pool {
        PoolKind::Small => "small",
        PoolKind::Large => "large",
    };
    let runs = segment.blocks.split(|b| b.state == BlockState::Unmapped);
    runs.filter(|run| !run.is_empty())
        .map(|run| {
            let (mut allocated, mut active, mut requested) = (0, 0, 0);
            let blocks: Vec<String> = run
                .iter()
                .map(|b| {
                    let state = match b.state {
                        BlockState::Active => "active_allocated",
                        BlockState::PendingFree => "active_pending_free",
                        BlockState::Free | BlockState::Unmapped => "inactive",
                    };
                    if b.state == BlockState::Active {
                        allocated += b.size;
                    }
                    if matches!(b.state, BlockState::Active | BlockState::PendingFree) {
                        active += b.size;
                        requested += b.requested_size;
                    }
                    format!(
                        "{{\"address\":{},\"size\":{},\"requested_size\":{},\"state\":\"{state}\",\"frames\":[]}}",
                        b.address, b.size, b.requested_size
                    )
                })
                .collect();
            format!(
                "{{\"device\":{device},\"address\":{},\"total_size\":{},\"allocated_size\":{allocated},\
                 \"active_size\":{active},\"requested_size\":{requested},\"stream\":{},\
                 \"segment_type\":\"{segment_type}\",\"segment_pool_id\":[{},{}],\
                 \"is_expandable\":{},\"frames\":[],\"blocks\":[{}]}}",
                run[0].address,
                run.iter().map(|b| b.size).sum::<u64>(),
                segment.stream,
                id >> 32,
                id & 0xFFFF_FFFF,
                segment.expandable,
                blocks.join(",")
            )
        })
        .collect()
}
