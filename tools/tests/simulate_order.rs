//! `simulate` with the recorded config reads which allocations the run served from a new
//! segment from the records around them: the segment's record comes just before its
//! allocation, under the same hold of the allocator's lock. Records written from outside the
//! lock (the recorder's stats samples, tags, stream creations) may land between the two in a
//! real trace; they must not hide the growth, or the replay serves the allocation from the cache
//! and quietly reserves less than the run.

mod common;

use std::path::Path;

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{MonotonicClock, Record, TraceWriter, WriterConfig};
use cachealloc_tools::analysis::scan;
use cachealloc_tools::commands::simulate::simulate_dir;
use cachealloc_tools::progress::Progress;
use common::scratch;

const MIB: u64 = 1 << 20;
const FIRST: u64 = 0x7f00_0000_0000;
const SECOND: u64 = 0x7f10_0000_0000;

/// Two threads each ask for 5 MiB; both miss the cache and grow a 20 MiB segment of their own
/// (the second grew while the first held no lock). `between` lands between the second
/// segment's record and its allocation.
fn race_trace(dir: &Path, between: Option<Record>) {
    let header = common::program::header("expandable_segments:False");
    let config = WriterConfig::new(dir, 1 << 30, 1, false);
    let mut w = TraceWriter::create(config, header, MonotonicClock).unwrap();
    let segment = |t, address| {
        Record::SegmentAlloc(SegmentEvent {
            t,
            device: 0,
            address,
            size: 20 * MIB,
            pool: POOL_LARGE,
            stack: 0,
        })
    };
    let alloc = |t, address, thread| {
        Record::Alloc(Alloc {
            t,
            device: 0,
            stream: 0,
            address,
            requested: 5 * MIB,
            size: 5 * MIB,
            stack: 0,
            thread,
        })
    };
    let mut records = vec![
        segment(1000, FIRST),
        alloc(2000, FIRST, 1),
        segment(3000, SECOND),
    ];
    records.extend(between);
    records.push(alloc(5000, SECOND, 2));
    for r in &records {
        w.write(r).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn records_from_outside_the_lock_do_not_hide_a_growth() {
    let interlopers = [
        ("nothing", None),
        (
            "a stats sample",
            Some(Record::StatsSample(StatsSample {
                t: 4000,
                device: 0,
                allocated: 5 * MIB,
                reserved: 40 * MIB,
                active: 5 * MIB,
                requested: 5 * MIB,
            })),
        ),
        (
            "a tag",
            Some(Record::Tag(TagEvent {
                t: 4000,
                device: 0,
                address: FIRST,
                category: 1,
            })),
        ),
        (
            "a stream creation",
            Some(Record::StreamCreated(StreamEvent {
                t: 4000,
                device: 0,
                stream: 0x1234,
                flags: 1,
            })),
        ),
    ];
    for (name, between) in interlopers {
        let dir = scratch(&format!("simulate-order-{}", name.replace(' ', "-")));
        race_trace(&dir, between);
        let recorded = scan(&dir, &Progress::new("test")).expect("scan");
        assert_eq!(recorded.devices[&0].peak_reserved.bytes, 40 * MIB, "{name}");
        let simulated = simulate_dir(&dir, None, None).expect("simulate");
        let sim = &simulated.devices[&0];
        assert_eq!(
            (sim.peak_reserved, sim.device_allocs),
            (40 * MIB, 2),
            "with {name} between a segment and its allocation: {simulated:?}"
        );
        assert_eq!(simulated.diverged_at, None, "{name}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
