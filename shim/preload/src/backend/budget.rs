//! The memory limit of a device, shared by all its pools.
//!
//! PyTorch's `set_per_process_memory_fraction` limits the memory the process reserves on a
//! device in all: the ordinary pool's segments, and those of every private pool (graph pools,
//! `MemPool`s), whichever asks. Each [`cachealloc_core::Allocator`] enforces the configured
//! fraction on its own segments; a [`DeviceBudget`] counts the memory every [`super::CudaDevice`]
//! of an ordinal holds from the driver (segments, and memory mapped into expandable segments)
//! and refuses a new segment or map beyond the limit, as the device would when full. The
//! allocator then climbs its out-of-memory ladder as on a full device (releasing cached
//! segments, then a `use_on_oom` pool's lending). The limit starts unlimited, is set from
//! `per_process_memory_fraction` when a device's pool is made, and by the program at run time
//! ([`set_limit`]).

use std::sync::atomic::{AtomicU64, Ordering};

/// Devices with a budget; memory of a device beyond them is never limited here.
const MAX_DEVICES: usize = 64;

/// What a device's pools hold from the driver, and how much they may.
#[derive(Debug)]
pub struct DeviceBudget {
    limit: AtomicU64,
    held: AtomicU64,
    /// The fraction of the device's memory the limit was set from, as `f64` bits
    /// ([`NO_FRACTION`]: never set).
    fraction: AtomicU64,
}

/// `DeviceBudget::fraction`'s value until a limit is set (not the bits of any fraction).
const NO_FRACTION: u64 = u64::MAX;

impl DeviceBudget {
    const fn new() -> Self {
        DeviceBudget {
            limit: AtomicU64::new(u64::MAX),
            held: AtomicU64::new(0),
            fraction: AtomicU64::new(NO_FRACTION),
        }
    }

    /// Count `bytes` more as held, unless that would pass the limit.
    pub fn take(&self, bytes: u64) -> bool {
        let limit = self.limit.load(Ordering::Acquire);
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    /// `bytes` went back to the driver.
    pub fn give_back(&self, bytes: u64) {
        let _ = (self.held).fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            Some(held.saturating_sub(bytes))
        });
    }

    /// The bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// The limit (`u64::MAX`: none).
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// The fraction of the device's memory the limit was set from, as given (PyTorch's
    /// `get_per_process_memory_fraction` reads it back exactly), if one was set.
    pub fn fraction(&self) -> Option<f64> {
        match self.fraction.load(Ordering::Acquire) {
            NO_FRACTION => None,
            bits => Some(f64::from_bits(bits)),
        }
    }
}

static BUDGETS: [DeviceBudget; MAX_DEVICES] = [const { DeviceBudget::new() }; MAX_DEVICES];

/// Device `ordinal`'s budget (one that never refuses for an ordinal of 64 or more).
pub fn of(ordinal: i32) -> &'static DeviceBudget {
    static UNLIMITED: DeviceBudget = DeviceBudget::new();
    usize::try_from(ordinal)
        .ok()
        .and_then(|i| BUDGETS.get(i))
        .unwrap_or(&UNLIMITED)
}

/// Limit what device `ordinal`'s pools hold to `bytes` in all, `fraction` of its memory (what
/// is already held stays; new memory is refused until it fits).
pub fn set_limit(ordinal: i32, bytes: u64, fraction: f64) {
    if let Some(budget) = usize::try_from(ordinal).ok().and_then(|i| BUDGETS.get(i)) {
        budget.limit.store(bytes, Ordering::Release);
        budget.fraction.store(fraction.to_bits(), Ordering::Release);
    }
}

/// Device `ordinal`'s memory is gone with its context (`cudaDeviceReset`): nothing is held.
pub fn forget_held(ordinal: i32) {
    if let Some(budget) = usize::try_from(ordinal).ok().and_then(|i| BUDGETS.get(i)) {
        budget.held.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_refuses_what_would_pass_its_limit_and_takes_back_what_is_given() {
        let b = DeviceBudget::new();
        assert!(b.take(u64::MAX - 1), "unlimited at first");
        b.give_back(u64::MAX - 1);
        b.limit.store(100, Ordering::Release);
        assert!(b.take(60));
        assert!(!b.take(41), "60 + 41 passes 100");
        assert_eq!(b.held(), 60, "a refusal takes nothing");
        assert!(b.take(40));
        b.give_back(70);
        assert_eq!(b.held(), 30);
        b.give_back(1000);
        assert_eq!(b.held(), 0, "never below zero");
    }

    #[test]
    fn a_limit_keeps_the_fraction_it_was_set_from_exactly() {
        assert_eq!(of(63).fraction(), None, "never set");
        set_limit(63, 0, 0.0);
        assert_eq!(of(63).fraction(), Some(0.0));
        set_limit(63, 123, 0.1);
        assert_eq!(of(63).fraction(), Some(0.1));
        assert_eq!(of(63).limit(), 123);
        assert_eq!(
            of(64).fraction(),
            None,
            "beyond the table: unlimited, no fraction"
        );
    }
}
