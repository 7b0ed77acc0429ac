//! Stack capture for allocation records: native frames, Python frames, or both
//! (`stacks:native|python|all`; `auto` means Python frames when the host is CPython).
//!
//! On the hot path only raw facts are taken: return addresses ([`native`], at most
//! `stack_depth` frames, skipping the frames inside this library) and, for Python, each frame's code object and instruction offset
//! ([`python::Python::walk`]). These are then interned under one lock:
//!
//! * a native frame by its address; the recorder's worker resolves its name, file and line off
//!   the hot path;
//! * a Python frame by its code object and offset; the code object's name, file and line table
//!   are read once (per object, checked for replacement) and the frame becomes
//!   `(function, file, line)`;
//! * a stack by its frame ids.
//!
//! A warm capture costs one lookup: stacks are also interned by their raw key (the addresses, and
//! per Python frame its code object and offset, and — unless the interpreter tells us when code
//! objects die, Note [Code objects' deaths] — what identifies the code object's contents), and
//! each thread finds the stacks it captured last by the raw key's hash without the interner's
//! lock (`recent`, Note [The thread's recent stacks]). The hash is taken from the walk's
//! buffers; the key itself is only built for the interner, when the thread's recent stacks miss.
//!
//! Anything new is defined in the trace (`FrameDef`, then `StackDef`) *before* its id is first
//! used: definitions are sent under the interner's lock, so any other thread that finds the stack
//! interned sends its events after them.
//!
//! With `stacks:all` a stack is the native frames, innermost first, followed by the Python frames
//! (the Python code is what called into the native code).
//!
//! Frames of code objects the Python integration hides ([`hide_python_code`]: its wrapper of
//! `nn.Module._call_impl`) are left out by the walk itself, before anything is read of their code
//! objects: a stack is the same with the integration's wrapper as without it, and costs no more.
//!
//! A thread with no frame to record (in PyTorch, the autograd engine's device threads, which run
//! the backward pass while the Python thread that called `backward()` waits) gets the stack of
//! the Python thread currently in `backward()`, which the Python integration announces through
//! `cachealloc_backward_begin`/`_end` ([`Stacks::set_backward`]).

pub mod frees;
pub mod native;
pub mod python;
mod recent;
mod scratch;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cachealloc_core::config::StackMode;
use cachealloc_recorder::Record;
use cachealloc_recorder::schema::{FRAME_NATIVE, FRAME_PYTHON, FrameDef, StackDef};
use rustc_hash::FxHashMap;

use crate::trace::Trace;
use native::NativeStacks;
use python::linetable::LineTable;
use python::{CodeCheck, CodeInfo, Python, RawFrame};
use scratch::Scratch;

/// Deepest stack captured, whatever `stack_depth` says.
const MAX_DEPTH: usize = 256;

/// Pause (or resume) stack capture (`cachealloc_stacks_pause`: records go on, with stack 0);
/// returns whether it was paused. A benchmark's switch: the cost of stacks measured within one
/// process, step by step (issue 25). A bit of the rare conditions' word, which every allocation
/// reads anyway.
pub fn pause(paused: bool) -> bool {
    crate::rare::switch(crate::rare::STACKS_PAUSED, paused)
}

/// Whether stack capture is paused.
#[inline]
pub fn paused() -> bool {
    crate::rare::any(crate::rare::STACKS_PAUSED)
}

/// Code objects whose frames stacks leave out (0: an empty place).
static HIDDEN_CODE: [AtomicUsize; 4] = [const { AtomicUsize::new(0) }; 4];

/// Leave the frames of the Python code object at `code` out of every stack from now on (the
/// Python integration's own wrappers, which sit between a program's frames). Returns false
/// when the places for such code objects are all taken (four).
pub fn hide_python_code(code: usize) -> bool {
    HIDDEN_CODE.iter().any(|place| {
        place.load(Ordering::Relaxed) == code
            || place
                .compare_exchange(0, code, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    })
}

/// The code objects whose frames stacks leave out now (0: an empty place).
fn hidden_code() -> [usize; 4] {
    HIDDEN_CODE.each_ref().map(|p| p.load(Ordering::Relaxed))
}

/// A code object's cached facts, and the frame ids of the offsets seen in it.
#[derive(Debug)]
struct CodeEntry {
    check: CodeCheck,
    name: Arc<str>,
    file: Arc<str>,
    lines: LineTable,
    first_line: i32,
    frames: FxHashMap<i32, u32>,
}

#[derive(Debug, Default)]
struct Interner {
    /// Stack ids by their frame ids.
    stacks: FxHashMap<Vec<u32>, u32>,
    /// Stack ids by what was read off the stack (the hot path's only lookup once warm).
    raw_stacks: FxHashMap<Box<[u64]>, u32>,
    /// The code objects' epoch `raw_stacks` was filled in (Note [Code objects' deaths]).
    epoch: u64,
    native_frames: FxHashMap<u64, u32>,
    codes: FxHashMap<usize, CodeEntry>,
    python_frames: HashMap<(Arc<str>, Arc<str>, i32), u32>,
    frame_count: u32,
    counts: CaptureCounts,
}

/// How captures went, for the exit summary: how many found their stack warm (and how many of
/// those in the thread's recent stacks), and how often the warm keys were forgotten because a
/// code object died.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CaptureCounts {
    /// Captures that reached the interner (a stack with at least one frame).
    pub captures: u64,
    /// Of those, the ones whose raw key was not cached (the cold path).
    pub cold: u64,
    /// Times the warm keys were forgotten (Note [Code objects' deaths]).
    pub forgotten: u64,
    /// Captures answered by the thread's recent stacks (Note [The thread's recent stacks]),
    /// counted in `captures` too.
    pub recent: u64,
}

impl Interner {
    fn define_frame(&mut self, trace: &Trace, mut def: FrameDef) -> u32 {
        self.frame_count += 1;
        def.id = self.frame_count;
        trace.send(Record::FrameDef(Box::new(def)));
        self.frame_count
    }

    fn native_frame(&mut self, trace: &Trace, ip: u64) -> u32 {
        if let Some(&id) = self.native_frames.get(&ip) {
            return id;
        }
        let id = self.define_frame(
            trace,
            FrameDef {
                id: 0,
                kind: FRAME_NATIVE,
                name: String::new(),
                file: String::new(),
                line: 0,
                address: ip,
            },
        );
        self.native_frames.insert(ip, id);
        id
    }

    /// # Safety
    ///
    /// `frame` must come from [`Python::walk`] on the calling thread, which must still be
    /// inside the same hook (its frames unchanged).
    unsafe fn python_frame(&mut self, trace: &Trace, python: &Python, frame: RawFrame) -> u32 {
        // SAFETY: as the caller guarantees: `frame.code` is a live code object.
        let check = unsafe { python.check(frame.code) };
        let entry = match self.codes.get_mut(&frame.code) {
            Some(entry) if entry.check == check => entry,
            _ => {
                // SAFETY: as above.
                let CodeInfo {
                    name,
                    file,
                    lines,
                    first_line,
                } = unsafe { python.describe(frame.code) };
                let entry = CodeEntry {
                    check,
                    name: name.into(),
                    file: file.into(),
                    lines,
                    first_line,
                    frames: FxHashMap::default(),
                };
                self.codes.insert(frame.code, entry);
                self.codes.get_mut(&frame.code).expect("just inserted")
            }
        };
        if let Some(&id) = entry.frames.get(&frame.offset) {
            return id;
        }
        let line = match u32::try_from(frame.offset) {
            Ok(offset) => entry.lines.line_at(offset).unwrap_or(0),
            Err(_) => entry.first_line,
        };
        let key = (entry.file.clone(), entry.name.clone(), line);
        let id = match self.python_frames.get(&key) {
            Some(&id) => id,
            None => {
                let def = FrameDef {
                    id: 0,
                    kind: FRAME_PYTHON,
                    name: key.1.to_string(),
                    file: key.0.to_string(),
                    line: line.max(0) as u32,
                    address: 0,
                };
                let id = self.define_frame(trace, def);
                self.python_frames.insert(key, id);
                id
            }
        };
        let entry = self.codes.get_mut(&frame.code).expect("present");
        entry.frames.insert(frame.offset, id);
        id
    }
}

/// Captures and interns stacks.
#[derive(Debug)]
pub struct Stacks {
    depth: usize,
    /// Native frames: the unwinder, made when first needed (by `stacks:native|all`, or when a
    /// program asks for C++ frames, [`Stacks::set_native`]).
    native: OnceLock<NativeStacks>,
    /// Whether native frames are captured now.
    native_on: AtomicBool,
    /// Whether the configuration asked for native frames (the program's wish cannot turn them
    /// off then).
    native_configured: bool,
    system_unwinder: bool,
    python: Option<Python>,
    interner: Mutex<Interner>,
    /// This interner's number, for the threads' recent stacks (Note [The thread's recent
    /// stacks]).
    number: u32,
    /// Captures answered by a thread's recent stacks (the interner counts the others).
    recent_hits: AtomicU64,
    /// The stack of the Python thread in `backward()`, for threads without frames (0: none).
    backward: AtomicU32,
}

impl Stacks {
    /// Stacks as `mode` asks, up to `depth` frames of each kind; `None` when that means none
    /// (`stacks:none`, or `auto` in a process that is not CPython). A Python stack that was
    /// asked for but cannot be had is reported once.
    pub fn new(mode: StackMode, depth: usize, system_unwinder: bool) -> Option<Stacks> {
        let (native, python) = match mode {
            StackMode::None => (false, false),
            StackMode::Auto | StackMode::Python => (false, true),
            StackMode::Native => (true, false),
            StackMode::All => (true, true),
        };
        let python = if python {
            match Python::detect() {
                Ok(p) => Some(p),
                Err(why) => {
                    if mode != StackMode::Auto {
                        let why = why.unwrap_or_else(|| "this process is not CPython".into());
                        crate::log::error!("stacks: no Python frames: {why}");
                    }
                    None
                }
            }
        } else {
            None
        };
        if !native && python.is_none() {
            return None;
        }
        let unwinder = OnceLock::new();
        if native {
            let _ = unwinder.set(NativeStacks::new(system_unwinder));
        }
        Some(Stacks {
            depth: depth.clamp(1, MAX_DEPTH),
            native: unwinder,
            native_on: AtomicBool::new(native),
            native_configured: native,
            system_unwinder,
            python,
            interner: Mutex::default(),
            number: {
                static NEXT: AtomicU32 = AtomicU32::new(1);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            recent_hits: AtomicU64::new(0),
            backward: AtomicU32::new(0),
        })
    }

    /// The stack to give threads that have no frame to record (0: none): the stack of the
    /// Python thread now in `backward()`. Returns the previous one, to put back after.
    pub fn set_backward(&self, stack: u32) -> u32 {
        self.backward.swap(stack, Ordering::AcqRel)
    }

    /// Capture native frames too from now on (`on`), or only what the configuration asked: a
    /// program's `_record_memory_history(stacks="all")` asks for C++ frames.
    pub fn set_native(&self, on: bool) {
        let on = on || self.native_configured;
        if on {
            self.native
                .get_or_init(|| NativeStacks::new(self.system_unwinder));
        }
        self.native_on.store(on, Ordering::Relaxed);
    }

    /// How captures have gone so far.
    pub fn counts(&self) -> CaptureCounts {
        let mut counts = self
            .interner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .counts;
        counts.recent = self.recent_hits.load(Ordering::Relaxed);
        counts.captures += counts.recent;
        counts
    }

    /// Whether Python frames are captured, and of which version.
    pub fn python_version(&self) -> Option<(u32, u32)> {
        self.python.as_ref().map(Python::version)
    }

    /// The calling thread's stack as an id (0 if it has no frame to record), sending the
    /// definitions of anything new to `trace` first.
    pub fn capture(&self, trace: &Trace) -> u32 {
        self.capture_skipping(trace, 0)
    }

    /// [`Stacks::capture`] without the `skip` innermost Python frames (the caller's own
    /// wrapper).
    pub fn capture_skipping(&self, trace: &Trace, skip: usize) -> u32 {
        let tstate = self.python.as_ref().and_then(Python::thread_state);
        let native = self
            .native
            .get()
            .filter(|_| self.native_on.load(Ordering::Relaxed));
        if tstate.is_none() && native.is_none() {
            // No frame to read (autograd's threads, which allocate half a training step): the
            // stack of the thread in `backward()`, without touching the thread's buffers.
            return self.backward.load(Ordering::Acquire);
        }
        // The thread's own buffers (`scratch`); during its exit they may be gone, and that
        // allocation goes without a stack.
        scratch::with(|scratch| self.capture_with(scratch, trace, skip, tstate, native))
            .unwrap_or(0)
    }

    /// [`Stacks::capture_skipping`] with the thread's buffers.
    ///
    /// # Note [A hit writes no frames]
    ///
    /// Nearly every capture finds a stack the thread has seen (the thread's recent stacks, Note
    /// [The thread's recent stacks]), and what it costs then is the cache lines it touches, the
    /// program's work having evicted them since the last allocation: the frames themselves (two
    /// lines each on 3.12, where a frame's code object and its instruction pointer are 56 bytes
    /// apart), the places of [`python::KnownCode`], and the buffer the frames were written to
    /// before they were hashed — 16 bytes a frame, ten more lines written for a 40-frame stack
    /// (`scripts/bench-cold-lines`). So where the key is the frames alone (code objects' deaths
    /// heard, epoch ≠ 0), the walk hands each frame to the hash ([`recent::KeyHash`]) and writes
    /// nothing down; only when the recent stacks miss does a second walk write the frames for
    /// the interner. Both walks see the same chain: the thread is parked in this hook, and they
    /// are given the same epoch and hidden code objects.
    fn capture_with(
        &self,
        scratch: &mut Scratch,
        trace: &Trace,
        skip: usize,
        tstate: Option<python::ThreadState>,
        native: Option<&NativeStacks>,
    ) -> u32 {
        let Scratch {
            ips,
            py,
            raw,
            recent,
            known,
        } = scratch;
        if ips.len() < self.depth {
            ips.resize(self.depth, 0);
            py.resize(self.depth, RawFrame::default());
        }
        let native = native.map_or(0, |n| n.capture(&mut ips[..self.depth]));
        // Read before the walk: the known code objects' table belongs to it (Note [Known code
        // objects]), and a frame's code object is alive from before the capture on.
        let epoch = python::code_deaths::epoch();
        let hidden = hidden_code();
        let walker = self.python.as_ref().zip(tstate);
        // Note [A hit writes no frames]: where code objects' deaths are heard, the key is the
        // frames alone, and a first walk hashes them as it finds them.
        let hashed_walk = epoch != 0 && walker.is_some();
        if hashed_walk && let Some((p, tstate)) = walker {
            let mut hash = recent::KeyHash::new(&ips[..native]);
            let walked = p.walk(tstate, skip..self.depth, known, epoch, &hidden, |frame| {
                hash.frame(frame)
            });
            if native + walked.saturating_sub(skip) == 0 {
                return self.backward.load(Ordering::Acquire);
            }
            if let Some(id) = recent.get(hash.finish(&[]), self.number, epoch) {
                self.recent_hits.fetch_add(1, Ordering::Relaxed);
                return id;
            }
        }
        // The frames written down: for the interner (the thread's recent stacks missed), or for
        // the code objects' checks (deaths not heard).
        let walked = walker.map_or(0, |(p, tstate)| {
            let mut n = 0;
            p.walk(tstate, 0..self.depth, known, epoch, &hidden, |frame| {
                py[n] = frame;
                n += 1;
            })
        });
        let skip = skip.min(walked);
        let (py, python) = (&py[skip..], walked - skip);
        if native + python == 0 {
            return self.backward.load(Ordering::Acquire);
        }
        // Where code objects' deaths are not heard (Note [Code objects' deaths]), what
        // identifies each code object's contents is part of the key, so that a code object
        // replaced at the same address is a miss.
        raw.clear();
        if epoch == 0
            && let Some(p) = &self.python
        {
            for frame in &py[..python] {
                // SAFETY: `frame` was just walked on this thread, which is still in the hook.
                let check = unsafe { p.check(frame.code) };
                raw.extend(check.map(|word| word as u64));
            }
        }
        let hash = recent::key_hash(&ips[..native], &py[..python], raw);
        // (The first walk's hash, if there was one, is this one, and missed.)
        if !hashed_walk && let Some(id) = recent.get(hash, self.number, epoch) {
            self.recent_hits.fetch_add(1, Ordering::Relaxed);
            return id;
        }
        // The raw key, for the interner: what was read off the stack (the addresses, then per
        // Python frame its code object and offset), then the checks (epoch 0).
        let checks = raw.len();
        raw.extend_from_slice(&ips[..native]);
        raw.extend(
            py[..python]
                .iter()
                .flat_map(|f| [f.code as u64, f.offset as u64]),
        );
        raw.rotate_left(checks);
        let raw = &raw[..];
        // SAFETY: `py` was just walked on this thread, which is still in the hook.
        let id = unsafe { self.intern(trace, raw, epoch, &ips[..native], &py[..python]) };
        recent.put(hash, self.number, epoch, id);
        id
    }

    /// The stack of raw key `raw` (read in code epoch `epoch`) from the interner, interning
    /// its frames (`ips`, then `py`) and itself when it is new.
    ///
    /// # Safety
    ///
    /// `py` must come from [`Python::walk`] on the calling thread, which must still be inside
    /// the same hook (its frames unchanged).
    unsafe fn intern(
        &self,
        trace: &Trace,
        raw: &[u64],
        epoch: u64,
        ips: &[u64],
        py: &[RawFrame],
    ) -> u32 {
        let (native, python) = (ips.len(), py.len());
        let mut interner = self.interner.lock().unwrap_or_else(|p| p.into_inner());
        interner.counts.captures += 1;
        if interner.epoch != epoch {
            if !interner.raw_stacks.is_empty() {
                interner.counts.forgotten += 1;
            }
            interner.raw_stacks.clear();
            interner.epoch = epoch;
        }
        if let Some(&id) = interner.raw_stacks.get(raw) {
            return id;
        }
        interner.counts.cold += 1;
        // First time this exact stack is seen (the cold path): intern its frames, then the
        // stack.
        let mut ids = Vec::with_capacity(native + python);
        for &ip in ips {
            ids.push(interner.native_frame(trace, ip));
        }
        if let Some(p) = &self.python {
            for &frame in py {
                // SAFETY: the caller guarantees `py` was walked on this thread, still in the
                // hook.
                ids.push(unsafe { interner.python_frame(trace, p, frame) });
            }
        }
        let frames = &ids[..];
        let id = match interner.stacks.get(frames) {
            Some(&id) => id,
            None => {
                let id = interner.stacks.len() as u32 + 1;
                trace.send(Record::StackDef(Box::new(StackDef {
                    id,
                    frames: frames.to_vec(),
                })));
                interner.stacks.insert(frames.to_vec(), id);
                id
            }
        };
        interner.raw_stacks.insert(raw.into(), id);
        id
    }
}
