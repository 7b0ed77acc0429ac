//! Record times taken as a CPU's tick counter, turned into nanoseconds by the worker.
//!
//! # Note [Record times in ticks]
//!
//! Every record carries a time. Read through the system (`clock_gettime`'s vDSO), a time costs
//! the program's thread ~30 ns and about five cache lines (the kernel's clock data, the anchor),
//! each a miss in a real step, where the program's own work between two allocations evicts
//! them (`scripts/bench-cold-lines`; design.md, "Where a traced record's cold lines go"). The
//! CPU's time-stamp counter is read by one instruction and touches no memory. So where the
//! counter can be trusted (the shim decides: an invariant counter, which the kernel's own clock
//! is built on), senders stamp records with ticks and the worker converts them, as PyTorch's
//! `ApproximateClock` does for its profiler.
//!
//! The conversion is anchored to the system's monotonic clock, not to a frequency measured
//! once: the worker takes *pairs* (ticks read just before and just after a `monotonic_ns()`,
//! their midpoint against it) at every drain, and a record's time is interpolated between the
//! two pairs around its ticks. So converted times are the monotonic clock's at every pair and
//! linear between them, a few tens of nanoseconds off at worst; they follow the system clock's
//! own rate corrections, and they do not drift from other processes' traces (rank alignment
//! uses the wall clock at the trace's anchor). A record newer than every pair gets a new pair
//! first, so nothing is extrapolated forward; one older than every pair kept (a worker many
//! seconds behind) is extrapolated back at the average rate of the pairs kept. Pairs closer than
//! [`MIN_SPACING_NS`] to the one before replace it, so the kept pairs span at least
//! `MAX_PAIRS × MIN_SPACING_NS` of the run and every interval between them is long enough that a
//! pair's error stays a small part of it.

use std::collections::VecDeque;

use crate::monotonic_ns;

/// Pairs kept (16 bytes each).
const MAX_PAIRS: usize = 4096;
/// The shortest interval between two kept pairs, but for the newest.
const MIN_SPACING_NS: u64 = 50_000;
/// The shortest span of pairs the first conversions wait for (the worker's, once a run).
const FIRST_SPAN_NS: u64 = 1_000_000;

/// A reading of the tick counter and the monotonic clock at the same moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pair {
    ticks: u64,
    ns: u64,
}

/// Turns ticks into nanoseconds of [`monotonic_ns`]'s clock (see the module's Note).
pub(crate) struct TickConverter {
    /// Reads a pair; the tests give their own.
    read_pair: Box<dyn FnMut() -> Pair + Send>,
    /// Strictly increasing in both fields.
    pairs: VecDeque<Pair>,
}

impl TickConverter {
    /// A converter for the counter `read_ticks` reads; takes its first pair now.
    pub(crate) fn new(read_ticks: fn() -> u64) -> TickConverter {
        TickConverter::with_pairs(Box::new(move || pair_of(read_ticks)))
    }

    fn with_pairs(mut read_pair: Box<dyn FnMut() -> Pair + Send>) -> TickConverter {
        let first = read_pair();
        TickConverter {
            read_pair,
            pairs: VecDeque::from([first]),
        }
    }

    /// Take a pair now (the worker, at each drain).
    pub(crate) fn observe(&mut self) {
        let pair = (self.read_pair)();
        self.push(pair);
    }

    fn push(&mut self, pair: Pair) {
        let Some(&last) = self.pairs.back() else {
            self.pairs.push_back(pair);
            return;
        };
        if pair.ticks <= last.ticks || pair.ns <= last.ns {
            return; // not later on both clocks: nothing to learn from it
        }
        // The newest pair stays only until a later one is far enough from the one before it.
        if let Some(&before) = self.pairs.get(self.pairs.len().wrapping_sub(2))
            && last.ns - before.ns < MIN_SPACING_NS
        {
            self.pairs.pop_back();
        }
        self.pairs.push_back(pair);
        if self.pairs.len() > MAX_PAIRS {
            self.pairs.pop_front();
        }
    }

    /// The time, in [`monotonic_ns`]'s nanoseconds, of `ticks`.
    pub(crate) fn nanoseconds(&mut self, ticks: u64) -> u64 {
        // Two pairs a useful span apart before the first conversion (only the first drain of
        // a run can find them closer; a clock that stands still is not waited for long).
        for _ in 0..4 {
            let span = self.span_ns();
            if span >= FIRST_SPAN_NS {
                break;
            }
            std::thread::sleep(std::time::Duration::from_nanos(FIRST_SPAN_NS - span));
            self.observe();
        }
        if ticks > self.last().ticks {
            self.observe();
        }
        let last = self.last();
        if ticks >= last.ticks {
            // Read after the newest pair (a pair that came out no later on both clocks was
            // not kept): at most the pair's own reading time ahead of it.
            return last.ns + self.scale(ticks - last.ticks, self.first(), last);
        }
        let first = self.first();
        if ticks < first.ticks {
            return first
                .ns
                .saturating_sub(self.scale(first.ticks - ticks, first, last));
        }
        // The first pair after `ticks`, and the one before it.
        let after = self.pairs.partition_point(|p| p.ticks <= ticks);
        let (a, b) = (self.pairs[after - 1], self.pairs[after]);
        a.ns + self.scale(ticks - a.ticks, a, b)
    }

    /// `ticks` ticks in nanoseconds at the rate between pairs `a` and `b`.
    fn scale(&self, ticks: u64, a: Pair, b: Pair) -> u64 {
        let (dt, dn) = (b.ticks - a.ticks, b.ns - a.ns);
        if dt == 0 {
            return 0;
        }
        (u128::from(ticks) * u128::from(dn) / u128::from(dt)).min(u128::from(u64::MAX)) as u64
    }

    fn first(&self) -> Pair {
        self.pairs[0]
    }

    fn last(&self) -> Pair {
        self.pairs[self.pairs.len() - 1]
    }

    fn span_ns(&self) -> u64 {
        self.last().ns - self.first().ns
    }
}

/// A pair from the counter `read_ticks`: the tightest of three tries (a try the thread was
/// preempted in is wide).
fn pair_of(read_ticks: fn() -> u64) -> Pair {
    let mut best: Option<(u64, Pair)> = None;
    for _ in 0..3 {
        let before = read_ticks();
        let ns = monotonic_ns();
        let after = read_ticks();
        let width = after.wrapping_sub(before);
        let pair = Pair {
            ticks: before + width / 2,
            ns,
        };
        if best.is_none_or(|(w, _)| width < w) {
            best = Some((width, pair));
        }
    }
    best.map(|(_, p)| p).expect("three tries")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A converter over a scripted clock: ticks run at 3 per ns from tick 1 000 at ns 0, the
    /// "system" clock at its own rate `ns_per_ns` (a corrected clock runs a little fast or
    /// slow against the counter); `now` is the true time the next pair is read at.
    fn scripted(ns_per_ns: f64) -> (TickConverter, Arc<Mutex<u64>>) {
        let now = Arc::new(Mutex::new(0u64));
        let clock = now.clone();
        let converter = TickConverter::with_pairs(Box::new(move || {
            let t = *clock.lock().unwrap();
            Pair {
                ticks: 1_000 + 3 * t,
                ns: (t as f64 * ns_per_ns) as u64,
            }
        }));
        (converter, now)
    }

    #[test]
    fn times_are_the_clocks_at_every_pair_and_linear_between() {
        let (mut c, now) = scripted(1.0);
        for t in [2_000_000u64, 3_000_000, 5_000_000] {
            *now.lock().unwrap() = t;
            c.observe();
        }
        assert_eq!(c.nanoseconds(1_000 + 3 * 3_000_000), 3_000_000, "at a pair");
        assert_eq!(
            c.nanoseconds(1_000 + 3 * 4_000_000),
            4_000_000,
            "between two"
        );
        assert_eq!(
            c.nanoseconds(1_000 + 3 * 2_500_000 + 1),
            2_500_000,
            "a third of a ns"
        );
        assert_eq!(c.nanoseconds(1_000), 0, "at the first pair");
        assert_eq!(
            c.nanoseconds(1),
            0,
            "before the run: clamped at the clock's zero"
        );
    }

    #[test]
    fn a_record_newer_than_every_pair_takes_a_new_pair_first() {
        // The system clock runs 1 % fast against the counter: extrapolating from the old
        // pairs would be 1 % off over the gap; a new pair makes it exact.
        let (mut c, now) = scripted(1.01);
        *now.lock().unwrap() = 10_000_000;
        c.observe();
        *now.lock().unwrap() = 30_000_000;
        assert_eq!(c.nanoseconds(1_000 + 3 * 30_000_000), 30_300_000);
        assert_eq!(
            c.nanoseconds(1_000 + 3 * 20_000_000),
            20_200_000,
            "between the new pairs"
        );
    }

    #[test]
    fn the_first_conversion_waits_for_a_span_of_pairs() {
        // Real clocks: the first pair and a record read at once; the converter waits until
        // its pairs span a millisecond, so the rate it uses is a millisecond's.
        fn ticks() -> u64 {
            monotonic_ns() * 2
        }
        let mut c = TickConverter::new(ticks);
        let t = ticks();
        let start = std::time::Instant::now();
        let ns = c.nanoseconds(t);
        assert!(start.elapsed() >= std::time::Duration::from_micros(900));
        assert!(c.span_ns() >= FIRST_SPAN_NS);
        let truth = t / 2;
        assert!(ns.abs_diff(truth) < 20_000, "{ns} against {truth}");
    }

    #[test]
    fn pairs_too_close_replace_the_newest_and_stale_ones_are_ignored() {
        let (mut c, now) = scripted(1.0);
        for t in [1_000_000u64, 1_010_000, 1_020_000, 1_100_000] {
            *now.lock().unwrap() = t;
            c.observe();
        }
        let kept: Vec<u64> = c.pairs.iter().map(|p| p.ns).collect();
        assert_eq!(kept, [0, 1_000_000, 1_100_000], "10 µs apart: replaced");
        *now.lock().unwrap() = 1_050_000; // a clock read that went back
        c.observe();
        assert_eq!(c.pairs.len(), 3);
        // Times stay exact whatever was dropped.
        assert_eq!(c.nanoseconds(1_000 + 3 * 1_050_000), 1_050_000);
    }

    #[test]
    fn the_oldest_pairs_go_and_older_records_use_the_average_rate() {
        let (mut c, now) = scripted(1.0);
        for i in 1..=(MAX_PAIRS as u64 + 10) {
            *now.lock().unwrap() = i * MIN_SPACING_NS;
            c.observe();
        }
        assert_eq!(c.pairs.len(), MAX_PAIRS);
        assert!(c.first().ns > 0, "the first pairs were let go");
        // Older than every pair kept: back at the kept pairs' rate, still exact here.
        assert_eq!(c.nanoseconds(1_000 + 3 * 7), 7);
    }

    #[test]
    fn conversions_never_go_back_as_ticks_go_forward() {
        let (mut c, now) = scripted(0.999_9);
        let mut t = 2_000_000u64;
        *now.lock().unwrap() = t;
        c.observe();
        let mut last = 0u64;
        for step in 0..20_000u64 {
            t += 1 + (step * 7919) % 997; // irregular steps
            if step % 50 == 0 {
                *now.lock().unwrap() = t;
                c.observe();
            }
            let ns = c.nanoseconds(1_000 + 3 * t);
            assert!(ns >= last, "step {step}: {ns} after {last}");
            last = ns;
        }
    }
}
