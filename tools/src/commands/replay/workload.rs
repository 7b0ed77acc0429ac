//! A trace's requests as a workload to replay: per recorded thread, its allocations and frees
//! in recorded order, each free paired with the allocation it frees.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use cachealloc_recorder::Record;
use cachealloc_recorder::reader::{TraceReader, read_file};
use serde::{Deserialize, Serialize};

use crate::{Error, one_trace};

/// One request of a replay thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes on the recorded `stream` (0: `cudaMalloc`); its pointer goes to
    /// allocation slot `slot`.
    Alloc {
        /// The allocation's slot (its ordinal among the workload's allocations).
        slot: u32,
        /// The application's request, in bytes.
        size: u64,
        /// The recorded stream handle.
        stream: u64,
    },
    /// Free the block of allocation `slot`, on the recorded `stream` (0: `cudaFree`).
    Free {
        /// The allocation freed.
        slot: u32,
        /// The recorded stream handle of the free.
        stream: u64,
    },
}

/// A trace's requests, ready to replay.
#[derive(Debug, Default)]
pub struct Workload {
    /// Per recorded thread number, its requests in recorded order.
    pub threads: BTreeMap<u32, Vec<Op>>,
    /// Per allocation slot: its size, recorded stream and thread.
    pub allocs: Vec<AllocInfo>,
    /// Frees paired with an allocation of the trace.
    pub frees: u64,
    /// The recorded streams (nonzero handles) and their creation flags where the trace saw the
    /// creation.
    pub streams: BTreeMap<u64, u32>,
    /// What was left out, and why.
    pub skipped: Skipped,
    /// The recorded device replayed.
    pub device: u32,
}

/// An allocation of the workload.
#[derive(Debug, Clone, Copy)]
pub struct AllocInfo {
    /// Requested bytes.
    pub size: u64,
    /// Recorded stream.
    pub stream: u64,
    /// Recorded thread number.
    pub thread: u32,
}

/// Records of the trace the replay leaves out.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Skipped {
    /// Frees of blocks allocated before the trace began (or whose allocation was not recorded).
    pub unpaired_frees: u64,
    /// Requests the run could not serve (OOM records): never served, so not replayed.
    pub ooms: u64,
    /// Allocations and frees of other devices.
    pub other_devices: u64,
    /// Blocks live when the trace began (a checkpoint lists them; their frees are unpaired).
    pub live_at_start: u64,
    /// Unreadable parts of files (a crash's torn tail): the records before them are replayed.
    pub tears: u64,
}

impl Workload {
    /// Number of requests (allocations and paired frees).
    pub fn requests(&self) -> u64 {
        self.allocs.len() as u64 + self.frees
    }
}

/// Read `path` (a trace directory, a directory holding exactly one, or one `trace-NNNNNN.cat`
/// file) into the workload of recorded device `device` (default: the trace's only device),
/// streaming its records. Refuses, naming what is missing, a trace without allocations, one of
/// several devices without `device`, and one whose first files were rotated away (unless
/// `partial`).
pub fn read(path: &Path, device: Option<u32>, partial: bool) -> Result<Workload, Error> {
    let name = path.display().to_string();
    let workload = if path.is_file() {
        let bytes = std::fs::read(path).map_err(|e| format!("{name}: {e}"))?;
        let (records, tear) = read_file(path, &bytes).map_err(|e| e.to_string())?;
        let mut w = build(
            records.into_iter().map(|r| Ok((0, r))),
            device,
            partial,
            &name,
        )?;
        w.skipped.tears = u64::from(tear.is_some());
        w
    } else {
        let dir = one_trace(path)?;
        let mut reader = TraceReader::open(&dir).map_err(|e| e.to_string())?;
        let items = reader.by_ref().map(|item| {
            item.map(|i| (i.file, i.record))
                .map_err(|e| Error::Message(e.to_string()))
        });
        let mut w = build(items, device, partial, &name)?;
        w.skipped.tears = reader.tears().len() as u64;
        w
    };
    Ok(workload)
}

/// One device's workload while it is being read.
#[derive(Default)]
struct Builder {
    w: Workload,
    /// The live allocation of each recorded address: its slot.
    live: HashMap<u64, u32>,
}

/// The workload of `records` (each with the index of the file it came from).
fn build(
    records: impl Iterator<Item = Result<(usize, Record), Error>>,
    device: Option<u32>,
    partial: bool,
    name: &str,
) -> Result<Workload, Error> {
    let mut devices: BTreeMap<u32, Builder> = BTreeMap::new();
    let mut header_seen = false;
    let mut in_checkpoint = false;
    for item in records {
        let (file, record) = item?;
        match record {
            Record::Header(h) => {
                in_checkpoint = true;
                if !header_seen && h.file_index > 0 && !partial {
                    return Err(Error::Message(format!(
                        "{name}: the trace's first {n} file(s) were rotated away (its oldest \
                         file is number {n}): the requests before it are missing, so a replay \
                         would not be the run's workload. Raise trace_files/trace_file_mb when \
                         recording, or pass --partial to replay what is left",
                        n = h.file_index
                    )));
                }
                header_seen = true;
            }
            Record::CheckpointEnd(_) => in_checkpoint = false,
            Record::CheckpointBlock(b) if in_checkpoint && file == 0 => {
                devices.entry(b.device).or_default().w.skipped.live_at_start += 1;
            }
            Record::StreamCreated(s) if s.stream != 0 => {
                devices
                    .entry(s.device)
                    .or_default()
                    .w
                    .streams
                    .insert(s.stream, s.flags);
            }
            Record::Alloc(a) => {
                let b = devices.entry(a.device).or_default();
                let slot = u32::try_from(b.w.allocs.len())
                    .map_err(|_| format!("{name}: more than 2^32 allocations"))?;
                let size = a.requested.max(1);
                b.w.allocs.push(AllocInfo {
                    size,
                    stream: a.stream,
                    thread: a.thread,
                });
                if a.stream != 0 {
                    b.w.streams.entry(a.stream).or_insert(1);
                }
                b.live.insert(a.address, slot);
                b.w.threads.entry(a.thread).or_default().push(Op::Alloc {
                    slot,
                    size,
                    stream: a.stream,
                });
            }
            Record::Free(f) | Record::FreeRequested(f) => {
                let b = devices.entry(f.device).or_default();
                let Some(slot) = b.live.remove(&f.address) else {
                    b.w.skipped.unpaired_frees += 1;
                    continue;
                };
                if f.stream != 0 {
                    b.w.streams.entry(f.stream).or_insert(1);
                }
                b.w.frees += 1;
                b.w.threads.entry(f.thread).or_default().push(Op::Free {
                    slot,
                    stream: f.stream,
                });
            }
            Record::Oom(o) => devices.entry(o.device).or_default().w.skipped.ooms += 1,
            _ => {}
        }
    }
    if !header_seen {
        return Err(Error::Message(format!(
            "{name}: not a replayable trace: it holds no file header (an empty or unreadable \
             trace file)"
        )));
    }
    // Devices that allocated, to choose and to name.
    devices.retain(|_, b| !b.w.allocs.is_empty());
    let list = || {
        devices
            .keys()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let chosen = match (device, devices.len()) {
        (_, 0) => {
            return Err(Error::Message(format!(
                "{name}: nothing to replay: the trace has no allocation records (the program \
                 made no CUDA allocation while it was traced)"
            )));
        }
        (Some(d), _) if !devices.contains_key(&d) => {
            return Err(Error::Message(format!(
                "{name}: the trace has no allocations on device {d} (it allocated on device(s) {})",
                list()
            )));
        }
        (Some(d), _) => d,
        (None, 1) => *devices.keys().next().expect("one device"),
        (None, _) => {
            return Err(Error::Message(format!(
                "{name}: the trace allocated on devices {}: choose one with --device",
                list()
            )));
        }
    };
    let other_devices: u64 = devices
        .iter()
        .filter(|(d, _)| **d != chosen)
        .map(|(_, b)| b.w.requests())
        .sum();
    let mut w = devices.remove(&chosen).expect("chosen among them").w;
    w.device = chosen;
    w.skipped.other_devices = other_devices;
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc_recorder::schema::{Alloc, CheckpointEnd, FreeRequested, Header};

    fn header(file_index: u32) -> Record {
        Record::Header(Box::new(Header {
            file_index,
            ..Header::new(1, "h")
        }))
    }

    fn alloc(device: u32, address: u64, size: u64, thread: u32) -> Record {
        Record::Alloc(Alloc {
            t: 0,
            device,
            stream: 0,
            address,
            requested: size,
            size,
            stack: 0,
            thread,
        })
    }

    fn free(device: u32, address: u64, thread: u32) -> Record {
        Record::Free(FreeRequested {
            t: 0,
            device,
            stream: 0,
            address,
            size: 0,
            stack: 0,
            thread,
        })
    }

    fn records(list: Vec<Record>) -> impl Iterator<Item = Result<(usize, Record), Error>> {
        let mut all = vec![header(0), Record::CheckpointEnd(CheckpointEnd { t: 0 })];
        all.extend(list);
        all.into_iter().map(|r| Ok((0, r)))
    }

    #[test]
    fn frees_pair_with_the_live_allocation_of_their_address() {
        // Address 0x100 is allocated twice: each free pairs with the allocation before it; the
        // free of 0x900 (allocated before the trace) is skipped.
        let w = build(
            records(vec![
                alloc(0, 0x100, 10, 1),
                free(0, 0x900, 1),
                free(0, 0x100, 2),
                alloc(0, 0x100, 20, 2),
                free(0, 0x100, 1),
            ]),
            None,
            false,
            "t",
        )
        .unwrap();
        assert_eq!(w.allocs.len(), 2);
        assert_eq!(w.frees, 2);
        assert_eq!(w.skipped.unpaired_frees, 1);
        assert_eq!(
            w.threads[&1],
            vec![
                Op::Alloc {
                    slot: 0,
                    size: 10,
                    stream: 0
                },
                Op::Free { slot: 1, stream: 0 }
            ]
        );
        assert_eq!(
            w.threads[&2],
            vec![
                Op::Free { slot: 0, stream: 0 },
                Op::Alloc {
                    slot: 1,
                    size: 20,
                    stream: 0
                }
            ]
        );
    }

    #[test]
    fn refusals_name_what_is_missing() {
        let err = |r: Result<Workload, Error>| match r {
            Err(Error::Message(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let m = err(build(records(vec![free(0, 1, 1)]), None, false, "t"));
        assert!(m.contains("no allocation records"), "{m}");
        let two = || records(vec![alloc(0, 1, 1, 1), alloc(1, 1, 1, 1)]);
        let m = err(build(two(), None, false, "t"));
        assert!(m.contains("devices 0, 1") && m.contains("--device"), "{m}");
        let m = err(build(two(), Some(3), false, "t"));
        assert!(m.contains("no allocations on device 3"), "{m}");
        let w = build(two(), Some(1), false, "t").unwrap();
        assert_eq!((w.allocs.len(), w.skipped.other_devices), (1, 1));
        // The oldest file left is number 2: files 0 and 1 were rotated away.
        let rotated = || {
            vec![header(2), alloc(0, 1, 1, 1)]
                .into_iter()
                .map(|r| Ok((0, r)))
        };
        let m = err(build(rotated(), None, false, "t"));
        assert!(m.contains("rotated away") && m.contains("--partial"), "{m}");
        assert_eq!(build(rotated(), None, true, "t").unwrap().allocs.len(), 1);
        let m = err(build(std::iter::empty(), None, false, "t"));
        assert!(m.contains("no file header"), "{m}");
    }
}
