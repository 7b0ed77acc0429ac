//! Peer access to pooled memory: a device that may use another's memory (the application
//! enabled peer access, or gave it access to the other's default memory pool, as PyTorch does)
//! may use the memory our pools hold for that device too; see `backend/vmm.rs`, Note [Peer
//! access to mapped memory].

use cachealloc_core::Expandable;

use super::Shim;
use crate::log;
use crate::settings;

impl Shim {
    /// The current device enabled peer access to `owner` (`cudaDeviceEnablePeerAccess`): give
    /// it access to the memory `owner`'s pools have mapped for expandable segments, as it has
    /// to `cudaMalloc`'s (see `backend/vmm.rs`, Note [Peer access to mapped memory]).
    pub fn peer_access_enabled(&self, owner: i32) {
        let accessor = match self
            .driver
            .and_then(crate::gpu::contexts::current_context_device)
        {
            Some(device) => device,
            None => match self.current_device() {
                Ok(device) => device,
                Err(_) => return,
            },
        };
        self.grant_peer_access(owner, accessor);
    }

    /// The current context enabled peer access to `peer_context` (`cuCtxEnablePeerAccess`): as
    /// [`Shim::peer_access_enabled`], when that context is a device's primary one (only those
    /// are pooled).
    pub fn peer_context_enabled(&self, peer_context: usize) {
        let owner = self
            .driver
            .and_then(|d| crate::gpu::contexts::device_of_primary_context(d, peer_context));
        if let Some(owner) = owner {
            self.peer_access_enabled(owner);
        }
    }

    /// `accessor` was given access to the default memory pool `pool` (PyTorch's
    /// `enablePeerAccess` on its `cudaMallocAsync` route, which enables no context's peer
    /// access): the memory our pools serve in that pool's stead must be usable by `accessor`
    /// as the driver pool's would be. Mapped memory is given access; `cudaMalloc`'s segments
    /// need the contexts' peer access, which is enabled (and may be refused: the driver allows
    /// a device only so many peers).
    pub fn default_pool_access_granted(&self, pool: usize, accessor: i32) {
        let (Some(owner), Some(driver)) = (self.default_pool_owner(pool), self.driver) else {
            return;
        };
        if owner == accessor || !self.pooling() {
            return;
        }
        // Only `cudaMalloc`'s segments need it: enabling it otherwise would make the program's
        // own `cudaDeviceEnablePeerAccess` answer "already enabled". Unless every request maps
        // (`expandable_segments:True` on a device that can), the pool has or may get some:
        // the default keeps them for the synchronous API.
        let every_request_maps = |mode: Expandable| mode == Expandable::On;
        let fixed_segments = match self.allocator_of(owner) {
            Some(alloc) => {
                cachealloc_core::Device::map_granularity(alloc.device()).is_none()
                    || !every_request_maps(alloc.config().expandable_segments)
            }
            None => !every_request_maps(settings::get().config.allocator.expandable_segments),
        };
        if fixed_segments
            && let Err(e) =
                crate::gpu::contexts::enable_context_peer_access(driver, accessor, owner)
        {
            log::error!(
                "device {accessor} was given access to device {owner}'s memory pool, but peer \
                 access between their contexts could not be enabled ({e}): its kernels cannot \
                 use device {owner}'s cudaMalloc segments"
            );
        }
        self.grant_peer_access(owner, accessor);
    }

    fn grant_peer_access(&self, owner: i32, accessor: i32) {
        if !crate::backend::note_peer_access(owner, accessor) {
            return; // already granted (the runtime's call and the driver's both come here)
        }
        let received = super::ipc::grant_received_to_peer(owner, accessor);
        if received > 0 {
            log::error!(
                "device {accessor} enabled peer access to device {owner}, but {received} ranges \
                 of memory received from other processes could not be shared with it \
                 (cuMemSetAccess failed)"
            );
        }
        // The private pools' mapped memory too; their later maps grant access as they are
        // made.
        let mut failed = 0;
        self.for_each_private_pool(owner, |alloc| {
            failed += alloc.device().grant_peer(accessor).unwrap_or(1);
        });
        if failed > 0 {
            log::error!(
                "device {accessor} enabled peer access to device {owner}, but {failed} mappings \
                 of device {owner}'s private pools could not be shared (cuMemSetAccess failed)"
            );
        }
        let Some(alloc) = self.allocator_of(owner) else {
            return; // no pool yet: its maps will grant access as they are made
        };
        match alloc.device().grant_peer(accessor) {
            Ok(0) => log::debug!(
                "device {accessor} enabled peer access to device {owner}: its mapped memory is \
                 shared"
            ),
            Ok(failed) => log::error!(
                "device {accessor} enabled peer access to device {owner}, but {failed} mappings \
                 of device {owner}'s memory could not be shared (cuMemSetAccess failed); \
                 kernels of device {accessor} reading them would fault"
            ),
            Err(e) => log::error!(
                "device {accessor} enabled peer access to device {owner}, but its mapped memory \
                 could not be shared: {e}"
            ),
        }
    }
}
