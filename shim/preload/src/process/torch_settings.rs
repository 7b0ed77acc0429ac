//! PyTorch's memory settings at run time, which the Python integration passes on from
//! `torch.cuda.memory`: the memory fraction (`set_per_process_memory_fraction`, for all of a
//! device's pools: `backend::budget`), the allocator settings (`_set_allocator_settings`) and
//! caching on or off (`caching_allocator_enable`).

use std::sync::atomic::{AtomicBool, Ordering};

use cachealloc_core::Device;
use cachealloc_core::config::Config;

use super::Shim;
use crate::cuda::{self, CudaError};
use crate::log;

impl Shim {
    /// Limit the memory `device`'s pools hold in all — the ordinary pool's and every private
    /// pool's, for PyTorch's stream-ordered requests — to `fraction` of the device's memory
    /// (PyTorch's `set_per_process_memory_fraction`, at run time); memory beyond it is refused
    /// as on a full device (`backend::budget`).
    pub fn set_memory_fraction(&self, device: i32, fraction: f64) -> Result<(), CudaError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(cuda::ERROR_INVALID_VALUE);
        }
        let total = self.pool(device)?.alloc.device().mem_info().total;
        let bytes = if fraction >= 1.0 {
            u64::MAX
        } else {
            cachealloc_core::sizes::limit_for_fraction(total, fraction)
        };
        // PyTorch's fraction counts PyTorch's memory, not the libraries' own (Note [Whose
        // memory a limit counts]).
        let scope = crate::backend::budget::Scope::PyTorch;
        crate::backend::budget::set_limit(device, bytes, fraction, scope);
        log::debug!("device {device}: its pools may hold {fraction} of {total} bytes");
        Ok(())
    }

    /// The fraction of `device`'s memory its pools may hold: the one set last (at run time, or
    /// from `per_process_memory_fraction` when the device's pool was made), else the
    /// configuration's (PyTorch's `get_per_process_memory_fraction`; 1.0: no limit).
    pub fn memory_fraction(&self, device: i32) -> f64 {
        if let Some(fraction) = crate::backend::budget::of(device).fraction() {
            return fraction;
        }
        self.allocator_config_now().per_process_memory_fraction
    }

    /// The settings a pool made now starts with: the configuration's, as the program changed
    /// them at run time (`_set_allocator_settings`).
    pub(super) fn allocator_config_now(&self) -> cachealloc_core::AllocatorConfig {
        (self.runtime_allocator.lock())
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| crate::settings::get().config.allocator.clone())
    }

    /// PyTorch's allocator settings changed at run time (`_set_allocator_settings`, a
    /// `PYTORCH_CUDA_ALLOC_CONF`-style string that PyTorch's own parser has accepted). As in
    /// PyTorch, the string replaces the settings: `max_split_size_mb`,
    /// `roundup_power2_divisions` and `garbage_collection_threshold` take the string's values,
    /// or their defaults, for every device's ordinary pool from the next request on (and for
    /// pools made later); `per_process_memory_fraction`, when given, limits each device's pools;
    /// `graph_capture_record_stream_reuse`, when given, switches reuse within captures (Note
    /// [Recorded streams]). PyTorch-only keys are PyTorch's. `expandable_segments`, when given,
    /// switches how the ordinary pools grow from now on (their segments of the other kind stay
    /// and serve what they hold, as with PyTorch's), and the private pools' (Note [Expandable
    /// private pools]). The error names the key and its valid values.
    pub fn set_allocator_settings(&self, text: &str) -> Result<(), String> {
        let resolved = Config::from_sources(None, Some(text)).map_err(|e| e.to_string())?;
        let policy = resolved.config.allocator;
        let given = |key: &str| {
            text.split(',')
                .any(|entry| entry.split(':').next().is_some_and(|k| k.trim() == key))
        };
        let expandable = given("expandable_segments").then_some(policy.expandable_segments);
        {
            // Pools made from now on start with these settings.
            let mut runtime = (self.runtime_allocator.lock()).unwrap_or_else(|p| p.into_inner());
            let mut made = runtime
                .take()
                .unwrap_or_else(|| crate::settings::get().config.allocator.clone());
            made.max_split_size = policy.max_split_size;
            made.roundup = policy.roundup.clone();
            made.garbage_collection_threshold = policy.garbage_collection_threshold;
            if let Some(on) = expandable {
                made.expandable_segments = on;
            }
            *runtime = Some(made);
        }
        for alloc in self.allocators() {
            alloc.set_policy(&policy);
            if let Some(on) = expandable
                && alloc.set_expandable(on) != on.any()
            {
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    log::info!(
                        "expandable_segments:True ignored: the device cannot map memory; \
                         using fixed segments"
                    );
                }
            }
        }
        if let Some(asked) = expandable {
            self.set_private_pools_expandable(asked);
        }
        if given("graph_capture_record_stream_reuse") {
            (self.recorded).set_reuse_in_capture(resolved.config.graph_capture_record_stream_reuse);
        }
        if given("per_process_memory_fraction") {
            for device in 0..self.device_count as i32 {
                self.set_memory_fraction(device, policy.per_process_memory_fraction)
                    .map_err(|e| format!("per_process_memory_fraction: {e}"))?;
            }
        }
        log::debug!("allocator settings from the program: {text}");
        Ok(())
    }

    /// The program turns caching on or off (PyTorch's `caching_allocator_enable`). While it is
    /// off, new allocations go to CUDA and are not counted in the statistics, as PyTorch's
    /// native allocator does; blocks allocated before return to their pools when freed.
    pub fn set_caching(&self, on: bool) {
        self.caching_off.store(!on, Ordering::Relaxed);
    }

    /// Whether caching is on (see [`Shim::set_caching`]).
    pub fn caching(&self) -> bool {
        !self.caching_off.load(Ordering::Relaxed)
    }
}
