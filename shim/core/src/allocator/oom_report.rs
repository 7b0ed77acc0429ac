//! The report of a request that could not be served: what the pools, the device and any limit
//! shared by the device's pools knew at that moment ([`OomReport`]).

use super::{Allocator, Request};
use crate::device::Device;
use crate::events::Observer;
use crate::oom::OomReport;
use crate::pools::Pools;
use crate::sizes;

impl<D: Device, O: Observer> Allocator<D, O> {
    /// What the pools and the device know about `request`, which could not be served.
    pub(super) fn oom_report(&self, pools: &Pools<D::Fence>, request: &Request) -> OomReport {
        let info = self.device.mem_info();
        let reserved = pools.stats.reserved_bytes.all.current as u64;
        let (limit, held_elsewhere) = match self.device.shared_limit() {
            Some(shared) if shared.limit < self.limit => {
                let counted = if shared.counts_synchronous {
                    reserved
                } else {
                    pools.stats.reserved_bytes.stream_ordered()[0].current as u64
                };
                (shared.limit, shared.held.saturating_sub(counted))
            }
            _ => (self.limit, 0),
        };
        let cached_free = pools.cached_free_bytes();
        let largest = pools.largest_free_block();
        OomReport {
            requested: request.size,
            rounded: request.rounded,
            pool: sizes::pool_for(request.rounded),
            segment_size: request.segment_size,
            allocated: pools.stats.allocated_bytes.all.current as u64,
            reserved,
            cached_free,
            largest_free_block: largest,
            fragmentation: if cached_free == 0 {
                0.0
            } else {
                1.0 - largest as f64 / cached_free as f64
            },
            device_free: info.free,
            device_total: info.total,
            limit,
            held_elsewhere,
            tag: request.tag,
        }
    }
}
