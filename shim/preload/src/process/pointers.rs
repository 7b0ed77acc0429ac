//! What the shim says about a pointer the application holds: the pooled block behind it (for
//! the driver's pointer queries; the live block a pointer is the base of, in any pool) and
//! whether it may be given an IPC handle.

use super::Shim;

/// A live pooled allocation, as the driver's pointer queries describe an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PooledBlock {
    /// Its base address (what the program got).
    pub base: u64,
    /// Its size (the request, rounded up).
    pub size: u64,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: unique per allocation in the process, never reused —
    /// a block handed out again at the same address is a new buffer.
    pub buffer_id: u64,
}

impl PooledBlock {
    /// Our buffer ids stay clear of the driver's, which count up from 1.
    const BUFFER_ID_BASE: u64 = 1 << 62;
}

impl Shim {
    /// The live allocation containing `address`, if it is one of ours. `Err(())` for an address
    /// inside our segments that is not live (a freed block): the program has no allocation
    /// there.
    pub fn pooled_block(&self, address: u64) -> Option<Result<PooledBlock, ()>> {
        self.devices.iter().enumerate().find_map(|(device, slot)| {
            let info = slot.get()?.alloc.lookup(address)?;
            Some(if info.state == cachealloc_core::BlockState::Active {
                Ok(PooledBlock {
                    base: info.block_address,
                    size: info.block_size,
                    buffer_id: PooledBlock::BUFFER_ID_BASE | (device as u64) << 48 | info.serial,
                })
            } else {
                Err(())
            })
        })
    }

    /// The device and size of the live block whose base is `address`, in an ordinary or a
    /// private pool.
    pub(super) fn live_block(&self, address: u64) -> Option<(i32, u64)> {
        let live = |info: Option<cachealloc_core::AddressInfo>| {
            info.filter(|i| {
                i.block_address == address && i.state == cachealloc_core::BlockState::Active
            })
            .map(|i| i.block_size)
        };
        let ordinary = self.devices.iter().enumerate().find_map(|(device, slot)| {
            let pool = slot.get()?;
            if !pool.may_contain(address) {
                return None;
            }
            live(pool.alloc.lookup(address)).map(|size| (device as i32, size))
        });
        ordinary.or_else(|| {
            let mut found = None;
            self.for_each_private_pool_anywhere(|device, alloc| {
                if found.is_none() && alloc.device().may_contain(address) {
                    found = live(alloc.lookup(address)).map(|size| (device, size));
                }
            });
            found
        })
    }
}
