//! Write a synthetic trace for benchmarking the tools: a training-like run driven through the
//! real allocator (`cachealloc-core` on a `SimDevice`), recorded as the shim records it.
//!
//! ```text
//! cargo run --release -p cachealloc-tools --example synthetic_trace -- DIR [EVENTS [RANKS]]
//! ```
//!
//! Each "step" allocates a forward pass's activations (sizes from a layer table, scaled by a
//! sequence length that cycles as in gpt2_train.py), frees them in reverse in the backward pass
//! with some gradient buffers in between, and allocates optimizer temporaries. Fifty allocation
//! sites with 20-frame Python stacks; a stats sample per 100 ms of simulated time, an
//! annotation per step. Records are written with zstd to 64 MiB files (all kept). EVENTS
//! (default 10 000 000) counts allocation and free records.
//!
//! With `SYNTHETIC_CONTEXT=1` in the environment (one trace only), the run also says what the
//! Python integration says of a training loop: module scopes (`Model.layers.N`, twelve layers),
//! phases (forward, backward, optimizer step, none between steps) and tags (parameters made
//! before the first step, gradients made in the first backward, both kept), an input batch per
//! step, optimizer temporaries and lazily created optimizer state: what `summary` with
//! categories is measured on.
//!
//! With RANKS, DIR becomes a job: one trace per rank, `DIR/synthetic-<pid>-rank<R>/`, each with
//! EVENTS records, `RANK` and `WORLD_SIZE` in its header. Ranks differ a little in their
//! activations (a per-rank scale of 1.00 to 1.30), and every 101st rank from rank 37 on is an
//! outlier (scale 1.8): what `cachealloc fleet` should find.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use cachealloc_core::sim::SimDevice;
use cachealloc_core::{Allocator, AllocatorConfig, Event, Observer, PoolKind};
use cachealloc_recorder::schema::*;
use cachealloc_recorder::{Record, TraceWriter, WriterConfig};

static NOW: AtomicU64 = AtomicU64::new(1_000_000);

/// Records the allocator's events as the shim's trace does.
#[derive(Default)]
struct Recording(Mutex<Vec<Record>>);

impl Observer for Recording {
    fn on_event(&self, event: Event<'_>) {
        let t = NOW.load(Ordering::Relaxed);
        let pool = |p: PoolKind| u8::from(p == PoolKind::Large);
        let record = match event {
            Event::Alloc(a) => Record::Alloc(Alloc {
                t,
                device: 0,
                stream: 0,
                address: a.address,
                requested: a.requested,
                size: a.size,
                stack: a.tag as u32,
                thread: 1,
            }),
            Event::FreeRequested(f) => {
                let body = FreeRequested {
                    t,
                    device: 0,
                    stream: 0,
                    address: f.address,
                    size: f.size,
                    stack: 0,
                    thread: 1,
                };
                if f.pending {
                    Record::FreeRequested(body)
                } else {
                    Record::Free(body)
                }
            }
            Event::FreeCompleted { address, size } => Record::FreeCompleted(FreeCompleted {
                t,
                device: 0,
                address,
                size,
            }),
            Event::SegmentAlloc {
                address,
                size,
                pool: p,
                tag,
            } => Record::SegmentAlloc(SegmentEvent {
                t,
                device: 0,
                address,
                size,
                pool: pool(p),
                stack: tag as u32,
            }),
            Event::SegmentFree(s) => Record::SegmentFree(SegmentEvent {
                t,
                device: 0,
                address: s.address,
                size: s.size,
                pool: pool(s.pool),
                stack: 0,
            }),
            Event::SegmentMap {
                address,
                size,
                pool: p,
                tag,
            } => Record::SegmentMap(SegmentEvent {
                t,
                device: 0,
                address,
                size,
                pool: pool(p),
                stack: tag as u32,
            }),
            Event::SegmentUnmap {
                address,
                size,
                pool: p,
            } => Record::SegmentUnmap(SegmentEvent {
                t,
                device: 0,
                address,
                size,
                pool: pool(p),
                stack: 0,
            }),
            Event::Oom(_) => return,
        };
        self.0.lock().unwrap().push(record);
    }
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: synthetic_trace DIR [EVENTS [RANKS]]";
    let dir = PathBuf::from(args.next().expect(usage));
    let events: u64 = args.next().map_or(10_000_000, |n| n.parse().expect(usage));
    let ranks: Option<u32> = args.next().map(|n| n.parse().expect(usage));
    let _ = std::fs::remove_dir_all(&dir);
    let Some(ranks) = ranks else {
        return write_trace(&dir, events, None, 1.0);
    };
    for rank in 0..ranks {
        let scale = if rank % 101 == 37 {
            1.8
        } else {
            1.0 + f64::from(rank % 7) * 0.05
        };
        let pid = 10_000 + rank;
        let trace = dir.join(format!("synthetic-{pid}-rank{rank}"));
        write_trace(&trace, events, Some((rank, ranks)), scale)?;
    }
    Ok(())
}

/// One trace of `events` alloc/free records; `rank`: (rank, world size); `scale` multiplies the
/// activations' sizes.
fn write_trace(
    dir: &std::path::Path,
    events: u64,
    rank: Option<(u32, u32)>,
    scale: f64,
) -> std::io::Result<()> {
    NOW.store(1_000_000, Ordering::Relaxed);
    let header = Header {
        version: FORMAT_VERSION,
        file_index: 0,
        pid: rank.map_or(4242, |(r, _)| 10_000 + r),
        host: "synthetic".into(),
        rank: rank.map_or(-1, |(r, _)| r as i32),
        local_rank: rank.map_or(-1, |(r, _)| (r % 8) as i32),
        world_size: rank.map_or(-1, |(_, n)| n as i32),
        cmdline: vec!["python".into(), "train.py".into()],
        wall_clock_base_ns: 1_790_000_000_000_000_000,
        monotonic_base_ns: 0,
        config: String::new(),
        devices: vec![DeviceInfo {
            index: 0,
            name: "Synthetic GPU".into(),
            total_memory: 80 << 30,
        }],
        modules: vec![],
    };
    let config = WriterConfig::new(dir, 64 << 20, 100_000, true);
    let mut writer = TraceWriter::create(config, header, cachealloc_recorder::MonotonicClock)?;

    // Fifty sites, each a 20-frame Python stack sharing its outer frames.
    let mut frame_id = 0;
    let mut frame = |w: &mut TraceWriter, name: String, line: u32| -> std::io::Result<u32> {
        frame_id += 1;
        w.write(&Record::FrameDef(Box::new(FrameDef {
            id: frame_id,
            kind: FRAME_PYTHON,
            name,
            file: "/workspace/model.py".into(),
            line,
            address: 0,
        })))?;
        Ok(frame_id)
    };
    let mut outer = vec![];
    for depth in 0..17 {
        outer.push(frame(&mut writer, format!("outer_{depth}"), 10 + depth)?);
    }
    for site in 1..=50u32 {
        let mut frames = vec![
            frame(&mut writer, format!("op_{site}"), 100 + site)?,
            frame(
                &mut writer,
                format!("Layer{}.forward", site % 12),
                200 + site,
            )?,
            frame(&mut writer, "Block.forward".into(), 300 + site % 6)?,
        ];
        frames.extend(outer.iter().rev());
        writer.write(&Record::StackDef(Box::new(StackDef { id: site, frames })))?;
    }

    let observer = Recording::default();
    let alloc = Allocator::with_observer(
        SimDevice::new(80 << 30),
        AllocatorConfig::default(),
        observer,
    );
    const LAYERS: [u64; 12] = [
        3 << 20,
        12 << 20,
        768 << 10,
        4 << 20,
        48 << 10,
        9 << 20,
        2 << 20,
        65536,
        16 << 20,
        1 << 20,
        6 << 20,
        512,
    ];
    let mut written = 0u64;
    let mut next_sample = 0u64;
    let mut step = 0u64;
    let mut rng = 0x9e3779b97f4a7c15u64;
    let flush = |writer: &mut TraceWriter, written: &mut u64| -> std::io::Result<()> {
        let records: Vec<Record> = std::mem::take(&mut *alloc.observer().0.lock().unwrap());
        for r in &records {
            if matches!(
                r,
                Record::Alloc(_) | Record::Free(_) | Record::FreeRequested(_)
            ) {
                *written += 1;
            }
            writer.write(r)?;
        }
        Ok(())
    };
    let tick = |ns: u64| NOW.fetch_add(ns, Ordering::Relaxed) + ns;
    let context = rank.is_none() && std::env::var_os("SYNTHETIC_CONTEXT").is_some();
    let mut program = context
        .then(|| Program::start(&mut writer, &alloc))
        .transpose()?;
    flush(&mut writer, &mut written)?;
    while written < events {
        step += 1;
        let t = tick(1000);
        writer.write(&Record::Annotation(Box::new(Annotation {
            t,
            name: format!("step {step}"),
            thread: 1,
        })))?;
        let seq = [128u64, 256, 512, 1024][(step % 4) as usize];
        if let Some(p) = &mut program {
            p.load_batch(&mut writer, &alloc, step)?;
            flush(&mut writer, &mut written)?;
            p.phase(&mut writer, PHASE_FORWARD, step)?;
        }
        let mut live = vec![];
        for layer in 0..96u64 {
            if let Some(p) = &program {
                p.scope(&mut writer, 2 + (layer / 8) as u32)?;
            }
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let base = LAYERS[(layer % 12) as usize];
            let size = (((base * seq / 512) as f64 * scale) as u64).max(512) + rng % 4096;
            let site = 1 + ((layer * 7 + rng % 3) % 50) as u32;
            tick(400 + rng % 800);
            live.push(
                alloc
                    .malloc(size, u64::from(site))
                    .expect("80 GiB is enough"),
            );
            flush(&mut writer, &mut written)?;
        }
        // Backward: free in reverse, with gradient temporaries in between.
        if let Some(p) = &mut program {
            p.scope(&mut writer, 0)?;
            p.phase(&mut writer, PHASE_BACKWARD, step)?;
            p.first_gradients(&mut writer, &alloc)?;
            flush(&mut writer, &mut written)?;
        }
        while let Some(a) = live.pop() {
            tick(300 + rng % 500);
            alloc.free(a.address).expect("ours");
            if a.size > (1 << 20) && live.len() % 3 == 0 {
                let g = alloc.malloc(a.size / 2, 49).expect("fits");
                tick(200);
                alloc.free(g.address).expect("ours");
            }
            flush(&mut writer, &mut written)?;
        }
        if let Some(p) = &mut program {
            p.phase(&mut writer, PHASE_OPTIMIZER, step)?;
            p.optimizer_step(&mut writer, &alloc)?;
            flush(&mut writer, &mut written)?;
            p.phase(&mut writer, PHASE_NONE, step)?;
        }
        let now = NOW.load(Ordering::Relaxed);
        if now >= next_sample {
            let s = alloc.stats();
            writer.write(&Record::StatsSample(StatsSample {
                t: now,
                device: 0,
                allocated: s.allocated_bytes.all.current as u64,
                reserved: s.reserved_bytes.all.current as u64,
                active: s.active_bytes.all.current as u64,
                requested: s.requested_bytes.all.current as u64,
            }))?;
            next_sample = now + 100_000_000;
        }
        writer.tick()?;
    }
    let last = writer.finish()?;
    if rank.is_none() {
        println!(
            "wrote {written} alloc/free records in {step} steps to {} (last file {})",
            dir.display(),
            last.display()
        );
    }
    Ok(())
}

/// What the Python integration would say of the synthetic training loop (`SYNTHETIC_CONTEXT`).
struct Program {
    /// Parameters' addresses and sizes (made before the first step, tagged).
    parameters: Vec<(u64, u64)>,
    /// Whether gradients and optimizer state exist yet (made once, kept).
    gradients: bool,
    optimizer_state: bool,
    /// The batch of the step before (freed when the next one is loaded).
    batch: Option<u64>,
}

type SimAllocator = Allocator<SimDevice, Recording>;

/// Write the allocator's records so far (before a tag that names their blocks).
fn drain(w: &mut TraceWriter, alloc: &SimAllocator) -> std::io::Result<()> {
    let records: Vec<Record> = std::mem::take(&mut *alloc.observer().0.lock().unwrap());
    records.iter().try_for_each(|r| w.write(r))
}

impl Program {
    /// Scope names and the parameters (twelve layers of 8 MiB, tagged).
    fn start(w: &mut TraceWriter, alloc: &SimAllocator) -> std::io::Result<Program> {
        w.write(&Record::ScopeName(Box::new(ScopeName {
            id: 1,
            name: "Model".into(),
        })))?;
        for layer in 0..12u32 {
            w.write(&Record::ScopeName(Box::new(ScopeName {
                id: 2 + layer,
                name: format!("Model.layers.{layer}"),
            })))?;
        }
        let mut parameters = vec![];
        for _ in 0..12 {
            let p = alloc.malloc(8 << 20, 50).expect("fits");
            parameters.push((p.address, p.size));
        }
        drain(w, alloc)?;
        let program = Program {
            parameters,
            gradients: false,
            optimizer_state: false,
            batch: None,
        };
        program.tag_all(w, TAG_PARAMETER)?;
        Ok(program)
    }

    fn tag_all(&self, w: &mut TraceWriter, category: u8) -> std::io::Result<()> {
        let t = NOW.load(Ordering::Relaxed);
        for &(address, _) in &self.parameters {
            w.write(&Record::Tag(TagEvent {
                t,
                device: 0,
                address,
                category,
            }))?;
        }
        Ok(())
    }

    fn phase(&self, w: &mut TraceWriter, phase: u8, step: u64) -> std::io::Result<()> {
        let t = NOW.fetch_add(100, Ordering::Relaxed) + 100;
        w.write(&Record::Phase(PhaseEvent { t, phase, step }))
    }

    fn scope(&self, w: &mut TraceWriter, scope: u32) -> std::io::Result<()> {
        let t = NOW.fetch_add(50, Ordering::Relaxed) + 50;
        w.write(&Record::Scope(ScopeEvent {
            t,
            thread: 1,
            scope,
        }))
    }

    /// Phase none: the last batch is dropped, the next one moved to the device.
    fn load_batch(
        &mut self,
        w: &mut TraceWriter,
        alloc: &SimAllocator,
        step: u64,
    ) -> std::io::Result<()> {
        self.phase(w, PHASE_NONE, step)?;
        if let Some(old) = self.batch.take() {
            alloc.free(old).expect("ours");
        }
        self.batch = Some(alloc.malloc(1 << 20, 48).expect("fits").address);
        Ok(())
    }

    /// In the first backward: a gradient per parameter, tagged, kept.
    fn first_gradients(
        &mut self,
        w: &mut TraceWriter,
        alloc: &SimAllocator,
    ) -> std::io::Result<()> {
        if std::mem::replace(&mut self.gradients, true) {
            return Ok(());
        }
        let t = NOW.load(Ordering::Relaxed);
        for &(_, size) in &self.parameters.clone() {
            let g = alloc.malloc(size, 47).expect("fits");
            drain(w, alloc)?;
            w.write(&Record::Tag(TagEvent {
                t,
                device: 0,
                address: g.address,
                category: TAG_GRADIENT,
            }))?;
        }
        Ok(())
    }

    /// Temporaries freed within the step; at the first step, two moments per parameter, kept
    /// (untagged: the lifetime rule names them).
    fn optimizer_step(
        &mut self,
        _w: &mut TraceWriter,
        alloc: &SimAllocator,
    ) -> std::io::Result<()> {
        if !std::mem::replace(&mut self.optimizer_state, true) {
            for &(_, size) in &self.parameters {
                alloc.malloc(size, 46).expect("fits");
                alloc.malloc(size, 46).expect("fits");
            }
        }
        for &(_, size) in &self.parameters {
            NOW.fetch_add(200, Ordering::Relaxed);
            let tmp = alloc.malloc(size / 4, 45).expect("fits");
            alloc.free(tmp.address).expect("ours");
        }
        Ok(())
    }
}
