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
//! ([`set_limit`]). Memory that recycling moved (mapped at a second place: cachealloc-core's
//! Note [Moving memory instead of unmapping it]) is counted once, and goes back with its last
//! place: an unmap of a parked place, or of a holder whose place is still mapped, frees
//! nothing (before, each gave its bytes back, and the count fell below what was held).
//!
//! # Note [Whose memory a limit counts]
//!
//! The pools also serve what libraries allocate for themselves through the synchronous API
//! (cuBLAS's 64 MiB a handle, cuDNN's, a `cudaMalloc` through ctypes: cachealloc-core's Note
//! [PyTorch's view of the statistics]). PyTorch's own allocator never sees that memory, so its
//! fraction never counts it: a program that ran a matmul before
//! `set_per_process_memory_fraction((reserved + 40 MiB) / total)` may still allocate 40 MiB
//! natively (PyTorch's `TestMemPool` limited-memory tests do exactly this). So a limit has a
//! scope ([`Scope`]): PyTorch's — set at run time, or given in `PYTORCH_CUDA_ALLOC_CONF` —
//! counts the memory of stream-ordered requests only, and memory made for the synchronous API
//! is never refused by it (the device itself still may); cachealloc's own, from
//! `CACHEALLOC_CONF`, counts everything the pools hold, as a C program that only calls
//! `cudaMalloc` needs. Each pool's own limit (cachealloc-core's, from the configuration at
//! start) counts the same way (`AllocatorConfig::fraction_counts_synchronous`). A trace's
//! recorded configuration does not say which: `cachealloc simulate` counts everything. To tell them apart, the
//! shim marks the requests of the synchronous API while it serves them
//! ([`for_synchronous_request`]); the budget remembers the addresses of the segments and
//! mappings made for them, and gives their bytes back to the right count when they go.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Devices with a budget; memory of a device beyond them is never limited here.
const MAX_DEVICES: usize = 64;

/// What a limit counts (Note [Whose memory a limit counts]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Everything the device's pools hold (cachealloc's `per_process_memory_fraction`).
    Everything,
    /// What PyTorch's allocator would hold: the memory of stream-ordered requests
    /// (`set_per_process_memory_fraction`).
    PyTorch,
}

thread_local! {
    /// Whether the calling thread is serving a request of the synchronous API.
    static SYNCHRONOUS_REQUEST: Cell<bool> = const { Cell::new(false) };
}

/// Run `f`, serving a request of the synchronous API (`cudaMalloc`, `cuMemAlloc`): the memory
/// it makes is the synchronous API's (Note [Whose memory a limit counts]).
pub fn for_synchronous_request<R>(f: impl FnOnce() -> R) -> R {
    super::with_thread_flag(&SYNCHRONOUS_REQUEST, f)
}

fn serving_synchronous_request() -> bool {
    SYNCHRONOUS_REQUEST.try_with(Cell::get).unwrap_or(false)
}

/// What a device's pools hold from the driver, and how much they may.
#[derive(Debug)]
pub struct DeviceBudget {
    limit: AtomicU64,
    /// Whether the limit leaves the synchronous API's memory out ([`Scope::PyTorch`]).
    pytorch_scope: AtomicBool,
    held: AtomicU64,
    /// Of `held`, the memory made for the synchronous API.
    held_synchronous: AtomicU64,
    /// Where the memory is that needs telling apart when it goes.
    places: Mutex<Places>,
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
            pytorch_scope: AtomicBool::new(false),
            held: AtomicU64::new(0),
            held_synchronous: AtomicU64::new(0),
            places: Mutex::new(Places::new()),
            fraction: AtomicU64::new(NO_FRACTION),
        }
    }

    /// Count `bytes` of new memory as held, unless the limit's count would pass it; the
    /// memory is the synchronous API's while the calling thread serves one of its requests.
    /// A refusal takes nothing; an acceptance is answered by [`DeviceBudget::made`] or
    /// [`DeviceBudget::not_made`].
    pub fn take(&self, bytes: u64) -> Option<Taken> {
        let synchronous = serving_synchronous_request();
        let pytorch = self.pytorch_scope.load(Ordering::Acquire);
        if synchronous && pytorch {
            self.held.fetch_add(bytes, Ordering::AcqRel);
        } else {
            let limit = self.limit.load(Ordering::Acquire);
            let exempt = if pytorch {
                self.held_synchronous.load(Ordering::Acquire)
            } else {
                0
            };
            (self.held)
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                    let after = held.checked_add(bytes)?;
                    (after.saturating_sub(exempt) <= limit).then_some(after)
                })
                .ok()?;
        }
        if synchronous {
            self.held_synchronous.fetch_add(bytes, Ordering::AcqRel);
        }
        Some(Taken { bytes, synchronous })
    }

    /// The memory `taken` counted was made at `addresses` (a segment's base, or each mapping's).
    pub fn made(&self, taken: Taken, addresses: impl IntoIterator<Item = u64>) {
        if taken.synchronous {
            self.places().synchronous.extend(addresses);
        }
    }

    /// Memory was mapped at a second place (`(from, to)`: a move; cachealloc-core's Note
    /// [Moving memory instead of unmapping it]): it is the same memory, of the same count, and
    /// it goes back to the device only with the last of its places.
    pub fn moved(&self, moves: impl IntoIterator<Item = (u64, u64)>) {
        let mut places = self.places();
        for (from, to) in moves {
            let memory = match places.shared.get(&from) {
                Some(&memory) => memory,
                None => {
                    places.memories += 1;
                    let memory = places.memories;
                    places.shared.insert(from, memory);
                    places.places_of.insert(memory, 1);
                    memory
                }
            };
            if places.shared.insert(to, memory).is_none() {
                *places.places_of.entry(memory).or_insert(0) += 1;
            }
            if places.synchronous.contains(&from) {
                places.synchronous.insert(to);
            }
        }
    }

    /// The memory `taken` counted was not made after all.
    pub fn not_made(&self, taken: Taken) {
        self.release(taken.bytes, taken.synchronous);
    }

    /// The segment or mapping of `bytes` at `address` went: its memory goes back to the
    /// device's count unless it is still mapped at another place.
    pub fn give_back(&self, address: u64, bytes: u64) {
        let (synchronous, last) = {
            let mut places = self.places();
            let synchronous = places.synchronous.remove(&address);
            (synchronous, places.unmapped(address))
        };
        if last {
            self.release(bytes, synchronous);
        }
    }

    fn places(&self) -> std::sync::MutexGuard<'_, Places> {
        self.places.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self, bytes: u64, synchronous: bool) {
        let less = |held: u64| Some(held.saturating_sub(bytes));
        let _ = (self.held).fetch_update(Ordering::AcqRel, Ordering::Acquire, less);
        if synchronous {
            let _ = (self.held_synchronous).fetch_update(Ordering::AcqRel, Ordering::Acquire, less);
        }
    }

    /// The bytes held now, as the limit counts them.
    pub fn held(&self) -> u64 {
        let held = self.held.load(Ordering::Acquire);
        if self.pytorch_scope.load(Ordering::Acquire) {
            held.saturating_sub(self.held_synchronous.load(Ordering::Acquire))
        } else {
            held
        }
    }

    /// What the limit counts.
    pub fn scope(&self) -> Scope {
        if self.pytorch_scope.load(Ordering::Acquire) {
            Scope::PyTorch
        } else {
            Scope::Everything
        }
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

/// Memory a [`DeviceBudget`] counted for a request, before it is made.
#[must_use]
#[derive(Clone, Copy, Debug)]
pub struct Taken {
    bytes: u64,
    synchronous: bool,
}

/// The places of a device's memory that its budget tells apart.
#[derive(Debug)]
struct Places {
    /// The segments and mappings of the synchronous API's memory (moved memory's new places
    /// too).
    synchronous: BTreeSet<u64>,
    /// Memory mapped at several places (moved): each place → its memory's number.
    shared: BTreeMap<u64, u64>,
    /// The number of places each such memory is mapped at.
    places_of: BTreeMap<u64, u32>,
    /// The last memory's number.
    memories: u64,
}

impl Places {
    const fn new() -> Places {
        Places {
            synchronous: BTreeSet::new(),
            shared: BTreeMap::new(),
            places_of: BTreeMap::new(),
            memories: 0,
        }
    }

    /// The place `address` is unmapped: whether it was its memory's last.
    fn unmapped(&mut self, address: u64) -> bool {
        let Some(memory) = self.shared.remove(&address) else {
            return true;
        };
        let Some(count) = self.places_of.get_mut(&memory) else {
            return true;
        };
        *count -= 1;
        if *count > 0 {
            return false;
        }
        self.places_of.remove(&memory);
        true
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

/// Limit what device `ordinal`'s pools hold to `bytes`, `fraction` of its memory, counting
/// what `scope` says (what is already held stays; new memory is refused until it fits).
pub fn set_limit(ordinal: i32, bytes: u64, fraction: f64, scope: Scope) {
    if let Some(budget) = usize::try_from(ordinal).ok().and_then(|i| BUDGETS.get(i)) {
        budget.limit.store(bytes, Ordering::Release);
        (budget.pytorch_scope).store(scope == Scope::PyTorch, Ordering::Release);
        budget.fraction.store(fraction.to_bits(), Ordering::Release);
    }
}

/// Device `ordinal`'s memory is gone with its context (`cudaDeviceReset`): nothing is held.
pub fn forget_held(ordinal: i32) {
    if let Some(budget) = usize::try_from(ordinal).ok().and_then(|i| BUDGETS.get(i)) {
        budget.held.store(0, Ordering::Release);
        budget.held_synchronous.store(0, Ordering::Release);
        *budget.places() = Places::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Take `bytes` made at `address`.
    fn made_at(b: &DeviceBudget, bytes: u64, address: u64) -> bool {
        b.take(bytes).map(|t| b.made(t, [address])).is_some()
    }

    #[test]
    fn a_budget_refuses_what_would_pass_its_limit_and_takes_back_what_is_given() {
        let b = DeviceBudget::new();
        let huge = b.take(u64::MAX - 1).expect("unlimited at first");
        b.not_made(huge);
        b.limit.store(100, Ordering::Release);
        assert!(made_at(&b, 60, 1));
        assert!(b.take(41).is_none(), "60 + 41 passes 100");
        assert_eq!(b.held(), 60, "a refusal takes nothing");
        assert!(made_at(&b, 40, 2));
        b.give_back(1, 60);
        assert_eq!(b.held(), 40);
        b.give_back(2, 1000);
        assert_eq!(b.held(), 0, "never below zero");
    }

    #[test]
    fn pytorchs_limit_leaves_the_synchronous_apis_memory_out_and_cachealloc_s_counts_it() {
        let b = DeviceBudget::new();
        b.limit.store(100, Ordering::Release);
        // A library's own cudaMalloc (cuBLAS's workspace), then PyTorch's tensors.
        let library = for_synchronous_request(|| made_at(&b, 80, 1));
        assert!(library, "within the limit");
        assert!(
            b.take(40).is_none(),
            "cachealloc's limit counts everything: 80 + 40 passes 100"
        );
        b.pytorch_scope.store(true, Ordering::Release);
        assert_eq!(
            b.held(),
            0,
            "PyTorch's limit does not count the library's memory"
        );
        assert!(made_at(&b, 90, 2), "PyTorch's 90 fit its 100");
        assert!(b.take(20).is_none(), "90 + 20 passes PyTorch's 100");
        assert!(
            for_synchronous_request(|| made_at(&b, 500, 3)),
            "PyTorch's limit never refuses the synchronous API"
        );
        // The library's 80 moved (mapped again at 7): the new place is the library's too.
        b.moved([(1, 7), (2, 8)]);
        b.give_back(1, 80);
        assert_eq!(b.held(), 90, "the moved memory was the library's");
        b.give_back(3, 500);
        assert_eq!(b.held(), 90);
        b.give_back(7, 80);
        b.pytorch_scope.store(false, Ordering::Release);
        assert_eq!(
            b.held(),
            90,
            "the library's memory went back to its own count"
        );
        assert!(b.take(20).is_none());
        assert!(made_at(&b, 10, 4));
    }

    #[test]
    fn moved_memory_goes_back_with_its_last_place() {
        let b = DeviceBudget::new();
        assert!(made_at(&b, 20, 1));
        assert!(made_at(&b, 20, 2));
        // Memory 1 moved to 3 (1 parked), then 3's to 4 (flipped places are not calls).
        b.moved([(1, 3)]);
        b.moved([(3, 4)]);
        b.give_back(3, 20);
        b.give_back(1, 20);
        assert_eq!(
            b.held(),
            40,
            "a place was cleared; the memory is still mapped at 4"
        );
        b.give_back(4, 20);
        assert_eq!(b.held(), 20, "its last place went");
        // A new mapping at a freed place is memory of its own, even when it moves in turn.
        assert!(made_at(&b, 20, 1));
        b.moved([(1, 5)]);
        b.give_back(5, 20);
        assert_eq!(b.held(), 40);
        b.give_back(1, 20);
        b.give_back(2, 20);
        assert_eq!(b.held(), 0);
    }

    #[test]
    fn a_limit_keeps_the_fraction_it_was_set_from_exactly() {
        assert_eq!(of(63).fraction(), None, "never set");
        set_limit(63, 0, 0.0, Scope::Everything);
        assert_eq!(of(63).fraction(), Some(0.0));
        set_limit(63, 123, 0.1, Scope::PyTorch);
        assert_eq!(of(63).fraction(), Some(0.1));
        assert_eq!(of(63).limit(), 123);
        assert_eq!(
            of(64).fraction(),
            None,
            "beyond the table: unlimited, no fraction"
        );
    }
}
