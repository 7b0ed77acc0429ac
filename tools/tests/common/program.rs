//! Hand-built traces of a program that says what it does (phases, module scopes, tags), for the
//! categories' tests: each block's category is known by construction.

use std::collections::HashMap;
use std::path::Path;

use cachealloc_recorder::schema::*;
use cachealloc_recorder::{MonotonicClock, Record, TraceWriter, WriterConfig};

/// A mebibyte.
pub const MIB: u64 = 1 << 20;

/// The one segment's address; blocks are laid out in it one after the other, never reused.
pub const BASE: u64 = 0x7f00_0000_0000;

/// The header of a hand-built trace: one 16 GiB device, the shim's config `config`.
pub fn header(config: &str) -> Header {
    Header {
        version: FORMAT_VERSION,
        file_index: 0,
        pid: 77,
        host: "test".into(),
        rank: -1,
        local_rank: -1,
        world_size: -1,
        cmdline: vec!["python".into(), "train.py".into()],
        wall_clock_base_ns: 1_790_000_000_000_000_000,
        monotonic_base_ns: 0,
        config: config.into(),
        devices: vec![DeviceInfo {
            index: 0,
            name: "Test GPU".into(),
            total_memory: 16 << 30,
        }],
        modules: vec![],
    }
}

/// A trace being written, with a clock of its own (1 µs per record).
pub struct Program {
    w: TraceWriter,
    t: u64,
    next: u64,
    /// Ordinal of the next `Alloc` record.
    pub allocs: u64,
}

impl Program {
    /// A trace in `dir`; `rotate_every_flush`: each [`Program::rotate`] starts a new file,
    /// `max_files` of which are kept.
    pub fn new(dir: &Path, rotate_every_flush: bool, max_files: u32) -> Program {
        let header = header("");
        let file_bytes = if rotate_every_flush { 1 } else { 1 << 30 };
        let config = WriterConfig::new(dir, file_bytes, max_files, false);
        let mut w = TraceWriter::create(config, header, MonotonicClock).unwrap();
        // Two stacks: a user's line under PyTorch's frames, and one of PyTorch alone.
        let frames = [
            (
                1,
                "linear",
                "/usr/lib/python3/dist-packages/torch/nn/modules/linear.py",
                125,
            ),
            (2, "forward", "/home/me/model.py", 42),
            (
                3,
                "_call_impl",
                "/usr/lib/python3/dist-packages/torch/nn/modules/module.py",
                1750,
            ),
            (4, "run", "/usr/lib/python3.12/runpy.py", 88),
        ];
        for (id, name, file, line) in frames {
            w.write(&Record::FrameDef(Box::new(FrameDef {
                id,
                kind: FRAME_PYTHON,
                name: name.into(),
                file: file.into(),
                line,
                address: 0,
            })))
            .unwrap();
        }
        w.write(&Record::StackDef(Box::new(StackDef {
            id: 1,
            frames: vec![1, 2, 3],
        })))
        .unwrap();
        w.write(&Record::StackDef(Box::new(StackDef {
            id: 2,
            frames: vec![1, 3, 4],
        })))
        .unwrap();
        let mut p = Program {
            w,
            t: 1000,
            next: BASE,
            allocs: 0,
        };
        let t = p.tick();
        p.write(Record::SegmentAlloc(SegmentEvent {
            t,
            device: 0,
            address: BASE,
            size: 64 << 20,
            pool: POOL_LARGE,
            stack: 0,
        }));
        p
    }

    /// The time of the last record (ns).
    pub fn now(&self) -> u64 {
        self.t
    }

    fn tick(&mut self) -> u64 {
        self.t += 1000;
        self.t
    }

    fn write(&mut self, r: Record) {
        self.w.write(&r).unwrap();
    }

    /// Name scope `id`.
    pub fn name_scope(&mut self, id: u32, name: &str) {
        self.write(Record::ScopeName(Box::new(ScopeName {
            id,
            name: name.into(),
        })));
    }

    /// Thread 1 enters scope `id` (0: none).
    pub fn scope(&mut self, scope: u32) {
        let t = self.tick();
        self.write(Record::Scope(ScopeEvent {
            t,
            thread: 1,
            scope,
        }));
    }

    /// The program enters `phase`.
    pub fn phase(&mut self, phase: u8) {
        let t = self.tick();
        self.write(Record::Phase(PhaseEvent { t, phase, step: 0 }));
    }

    /// A block of `size` bytes allocated by thread 1 with stack 1; its address.
    pub fn alloc(&mut self, size: u64) -> u64 {
        let t = self.tick();
        let address = self.next;
        self.next += size.next_multiple_of(512);
        self.write(Record::Alloc(Alloc {
            t,
            device: 0,
            stream: 0,
            address,
            requested: size,
            size,
            stack: 1,
            thread: 1,
        }));
        self.allocs += 1;
        address
    }

    /// Free the block at `address` (of `size` bytes) at once.
    pub fn free(&mut self, address: u64, size: u64) {
        let free = self.free_of(address, size);
        self.write(Record::Free(free));
    }

    /// Ask to free the block at `address` (of `size` bytes): it stays pending (another
    /// stream's work may still use it) until [`Program::free_completed`].
    pub fn free_requested(&mut self, address: u64, size: u64) {
        let free = self.free_of(address, size);
        self.write(Record::FreeRequested(free));
    }

    /// Thread 1's free of the block at `address`, now, without a stack.
    fn free_of(&mut self, address: u64, size: u64) -> FreeRequested {
        FreeRequested {
            t: self.tick(),
            device: 0,
            stream: 0,
            address,
            size,
            stack: 0,
            thread: 1,
        }
    }

    /// The pending free of the block at `address` completes.
    pub fn free_completed(&mut self, address: u64, size: u64) {
        let t = self.tick();
        self.write(Record::FreeCompleted(FreeCompleted {
            t,
            device: 0,
            address,
            size,
        }));
    }

    /// Map `size` bytes at `address` of an expandable segment (stack 1), or unmap them (no
    /// stack of its own: the recycling of a later allocation).
    pub fn map(&mut self, address: u64, size: u64, map: bool) {
        let t = self.tick();
        let event = SegmentEvent {
            t,
            device: 0,
            address,
            size,
            pool: POOL_LARGE,
            stack: if map { 1 } else { 0 },
        };
        self.write(if map {
            Record::SegmentMap(event)
        } else {
            Record::SegmentUnmap(event)
        });
    }

    /// Tag the block holding `address` (here: inside it) with `category`.
    pub fn tag(&mut self, address: u64, category: u8) {
        let t = self.tick();
        self.write(Record::Tag(TagEvent {
            t,
            device: 0,
            address: address + 256,
            category,
        }));
    }

    /// Write what is pending as a chunk (a new file when rotating).
    pub fn rotate(&mut self) {
        self.w.flush().unwrap();
    }

    /// Finish the trace.
    pub fn finish(self) {
        self.w.finish().unwrap();
    }
}

/// The blocks of [`training_step`]: name → (ordinal among allocations, address, size).
pub type Blocks = HashMap<&'static str, (u64, u64, u64)>;

/// One training step and an inference forward, each block made to fall under one rule.
/// `activation` sets the size of the activation block (to compare two runs); `rotate`: a new
/// file at every phase change.
pub fn training_step(dir: &Path, activation: u64, rotate: bool) -> Blocks {
    let mut p = Program::new(dir, rotate, 1000);
    let mut blocks = Blocks::new();
    let mut alloc = |p: &mut Program, name: &'static str, size: u64| {
        let ordinal = p.allocs;
        let address = p.alloc(size);
        blocks.insert(name, (ordinal, address, size));
        address
    };
    let phase = |p: &mut Program, phase: u8| {
        if rotate {
            p.rotate();
        }
        p.phase(phase);
    };
    for (id, name) in [
        (1, "Net"),
        (2, "Net.encoder"),
        (3, "Net.encoder.attn"),
        (4, "Net.head"),
    ] {
        p.name_scope(id, name);
    }
    let param = alloc(&mut p, "parameter", 4 * MIB);
    p.tag(param, TAG_PARAMETER);
    let input = alloc(&mut p, "input", MIB);
    let early = alloc(&mut p, "none freed before forward", 64 << 10);
    p.free(early, 64 << 10);

    phase(&mut p, PHASE_FORWARD);
    p.scope(2);
    let act = alloc(&mut p, "activation", activation);
    p.scope(3);
    let tmp = alloc(&mut p, "forward temporary", 128 << 10);
    p.free(tmp, 128 << 10);
    let tagged = alloc(&mut p, "forward tagged input", 3 * MIB);
    p.tag(tagged, TAG_INPUT);
    p.scope(4);
    let kept = alloc(&mut p, "forward kept past backward", 5 * MIB);
    p.scope(0);

    phase(&mut p, PHASE_NONE);
    let loss = alloc(&mut p, "loss saved for backward", 256 << 10);

    phase(&mut p, PHASE_BACKWARD);
    p.free(act, activation);
    p.free(tagged, 3 * MIB);
    p.free(loss, 256 << 10);
    let grad = alloc(&mut p, "gradient", 4 * MIB);
    p.tag(grad, TAG_GRADIENT);
    let detail = alloc(&mut p, "backward temporary", 512 << 10);
    p.free(detail, 512 << 10);
    alloc(&mut p, "backward kept", 768 << 10);

    phase(&mut p, PHASE_OPTIMIZER);
    alloc(&mut p, "optimizer state", 8 * MIB);
    let opt_tmp = alloc(&mut p, "optimizer temporary", 1536 << 10);
    p.free(opt_tmp, 1536 << 10);

    phase(&mut p, PHASE_NONE);
    p.free(input, MIB);
    p.free(kept, 5 * MIB);

    phase(&mut p, PHASE_FORWARD);
    let inference = alloc(&mut p, "inference output", 6 * MIB);
    phase(&mut p, PHASE_NONE);
    p.free(inference, 6 * MIB);
    p.finish();
    blocks
}
