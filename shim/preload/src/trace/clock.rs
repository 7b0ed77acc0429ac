//! What times the records: the CPU's tick counter where it can be trusted, converted to
//! nanoseconds by the recorder's worker (Note [Record times in ticks] in `cachealloc-recorder`),
//! else the system's monotonic clock.
//!
//! `clock:auto` (the default) takes the counter where the kernel's own clock is built on it:
//! the CPU says its counter is invariant (it runs at one rate whatever the core's frequency or
//! sleep state) and the kernel's clock source is `tsc`, which the kernel chooses only after it
//! has checked that the counters of all CPUs agree. `clock:tsc` takes it wherever the CPU says
//! it is invariant (a virtual machine whose kernel prefers its hypervisor's clock); `clock:os`
//! never. Anything but x86-64 uses the monotonic clock.

use cachealloc_core::config::ClockChoice;

/// Where the kernel names its clock source.
const CLOCK_SOURCE: &str = "/sys/devices/system/clocksource/clocksource0/current_clocksource";

/// How the records of this process are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordClock {
    /// [`read_ticks`]: the worker converts.
    Ticks,
    /// `cachealloc_recorder::monotonic_ns`.
    Os,
}

impl RecordClock {
    /// The clock `choice` asks for, on this machine; with why not, where the counter was asked
    /// for and cannot be used.
    pub fn choose(choice: ClockChoice) -> (RecordClock, Option<String>) {
        match choice {
            ClockChoice::Os => (RecordClock::Os, None),
            ClockChoice::Auto => match counter_usable(true) {
                Ok(()) => (RecordClock::Ticks, None),
                Err(_) => (RecordClock::Os, None),
            },
            ClockChoice::Tsc => match counter_usable(false) {
                Ok(()) => (RecordClock::Ticks, None),
                Err(why) => (
                    RecordClock::Os,
                    Some(format!(
                        "clock:tsc: {why}; records are timed by the system's clock"
                    )),
                ),
            },
        }
    }
}

/// Whether the tick counter can time records: invariant, and (`kernel_too`) the kernel's own
/// clock source.
fn counter_usable(kernel_too: bool) -> Result<(), String> {
    if !invariant_counter() {
        return Err("this CPU's time-stamp counter is not invariant".into());
    }
    if kernel_too {
        let source = std::fs::read_to_string(CLOCK_SOURCE).map_err(|e| e.to_string())?;
        if source.trim() != "tsc" {
            return Err(format!("the kernel's clock source is {}", source.trim()));
        }
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
// `__cpuid` is a safe function on recent compilers, an unsafe one on the MSRV's.
#[allow(unused_unsafe)]
fn invariant_counter() -> bool {
    use std::arch::x86_64::__cpuid;
    // SAFETY: every x86-64 CPU has `cpuid`; leaf 0x8000_0000 says which extended leaves exist,
    // and 0x8000_0007 is read only where it does.
    unsafe {
        // Leaf 0x8000_0007, EDX bit 8: the invariant TSC (Intel's and AMD's manuals).
        __cpuid(0x8000_0000).eax >= 0x8000_0007 && __cpuid(0x8000_0007).edx & (1 << 8) != 0
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn invariant_counter() -> bool {
    false
}

/// The CPU's tick counter (`rdtsc`). Not ordered with the instructions around it, which a
/// record's time does not need: it is within a few nanoseconds of the event either way.
#[cfg(target_arch = "x86_64")]
pub fn read_ticks() -> u64 {
    // SAFETY: `rdtsc` reads a register; every x86-64 CPU has it and it touches no memory
    // (user-mode reads are allowed unless the kernel set CR4.TSD, which Linux does only for a
    // process that asked, by `prctl(PR_SET_TSC)` — and the kernel's own vDSO clock reads it).
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// Never called where [`RecordClock::choose`] gives [`RecordClock::Os`] (everywhere but
/// x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn read_ticks() -> u64 {
    cachealloc_recorder::monotonic_ns()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_is_always_os_and_auto_or_tsc_follow_the_machine() {
        assert_eq!(
            RecordClock::choose(ClockChoice::Os),
            (RecordClock::Os, None)
        );
        let (auto, why) = RecordClock::choose(ClockChoice::Auto);
        assert_eq!(why, None, "auto falls back without a word");
        assert_eq!(auto == RecordClock::Ticks, counter_usable(true).is_ok());
        let (tsc, why) = RecordClock::choose(ClockChoice::Tsc);
        assert_eq!(tsc == RecordClock::Ticks, invariant_counter());
        assert_eq!(why.is_some(), !invariant_counter());
        if auto == RecordClock::Ticks {
            assert_eq!(
                tsc,
                RecordClock::Ticks,
                "tsc takes the counter wherever auto does"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn ticks_go_forward_with_time() {
        if !invariant_counter() {
            return; // nothing to say of a counter the shim never uses
        }
        let a = read_ticks();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = read_ticks();
        // Any invariant counter runs at more than a megahertz.
        assert!(b > a + 2_000, "{a} then {b}");
    }
}
