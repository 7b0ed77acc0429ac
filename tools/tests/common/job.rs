//! A synthetic job of many ranks for the dataset's and `fleet`'s tests: each rank's trace written
//! with the recorder's writer, a few ranks planted as outliers.

use std::path::{Path, PathBuf};

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{MonotonicClock, Record, TraceWriter, WriterConfig};

/// Allocations per step of a synthetic rank, and steps.
pub const ALLOCS: u64 = 20;
pub const STEPS: u64 = 10;

/// Whether `rank` is one of the planted outliers (10 of 1 000).
pub fn outlier(rank: u32) -> bool {
    rank % 101 == 37
}

/// A rank's trace: one segment holding the step's blocks, `STEPS` steps of `ALLOCS` allocations
/// (from two stacks) freed again, an annotation per step. Outliers allocate twice as much.
pub fn write_rank(dir: &Path, rank: u32, world: u32) {
    let scale = if outlier(rank) {
        200
    } else {
        100 + u64::from(rank % 5)
    };
    let sizes: Vec<u64> = (1..=ALLOCS).map(|i| (i << 20) * scale / 100).collect();
    let total: u64 = sizes.iter().sum();
    let segment = (total / (2 << 20) + 2) * (2 << 20);
    let header = Header {
        rank: rank as i32,
        local_rank: (rank % 8) as i32,
        world_size: world as i32,
        cmdline: vec!["train.py".into()],
        wall_clock_base_ns: 1_790_000_000_000_000_000,
        ..Header::new(1000 + rank, "node-a")
    };
    let config = WriterConfig::new(dir, 64 << 20, 8, true);
    let mut w = TraceWriter::create(config, header, MonotonicClock).unwrap();
    for (id, name) in [(1, "forward"), (2, "backward")] {
        w.write(&Record::FrameDef(Box::new(FrameDef {
            id,
            kind: FRAME_PYTHON,
            name: name.into(),
            file: "model.py".into(),
            line: id * 10,
            address: 0,
        })))
        .unwrap();
        w.write(&Record::StackDef(Box::new(StackDef {
            id,
            frames: vec![id],
        })))
        .unwrap();
    }
    let base = 0x7f00_0000_0000u64;
    let mut t = 1000;
    w.write(&Record::SegmentAlloc(SegmentEvent {
        t,
        device: 0,
        address: base,
        size: segment,
        pool: POOL_LARGE,
        stack: 1,
    }))
    .unwrap();
    for step in 0..STEPS {
        t += 1000;
        w.write(&Record::Annotation(Box::new(Annotation {
            t,
            name: format!("step {step}"),
            thread: 1,
        })))
        .unwrap();
        let mut address = base;
        let mut blocks = vec![];
        for (i, &size) in sizes.iter().enumerate() {
            t += 100;
            let stack = 1 + (i as u32 % 2);
            w.write(&Record::Alloc(Alloc {
                t,
                device: 0,
                stream: 0,
                address,
                requested: size,
                size,
                stack,
                thread: 1,
            }))
            .unwrap();
            blocks.push((address, size));
            address += size;
        }
        for (address, size) in blocks {
            t += 100;
            w.write(&Record::Free(FreeRequested {
                t,
                device: 0,
                stream: 0,
                address,
                size,
                stack: 0,
                thread: 1,
            }))
            .unwrap();
        }
    }
    w.finish().unwrap();
}

/// A job of `ranks` ranks under `dir`.
pub fn write_job(dir: &Path, ranks: u32) -> PathBuf {
    for rank in 0..ranks {
        write_rank(
            &dir.join(format!("node-a-{}-rank{rank}", 1000 + rank)),
            rank,
            ranks,
        );
    }
    dir.to_path_buf()
}
