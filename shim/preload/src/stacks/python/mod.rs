//! Python stacks: the calling thread's Python frames, read without the GIL.
//!
//! # Why read memory instead of calling the frame API
//!
//! PyTorch releases the GIL around its operators, so `cudaMalloc` usually reaches us on a thread
//! that has a Python thread state but not the GIL. Taking the GIL inside the hook can deadlock
//! (the holder may be waiting for this very allocation), and the public frame API needs it.
//! But that thread's own frame chain cannot change while the thread is parked in our hook: only
//! the thread itself pushes and pops its frames, and the code objects those frames run are kept
//! alive by them. So we read the chain directly, through the layout of the running version
//! ([`layout`]), with no reference counting and no allocation in the interpreter.
//!
//! When the GIL *is* held (a C extension calling `cudaMalloc` without releasing it), the same
//! read is just as safe, and cheaper than the public API, which would create frame objects
//! inside an allocation hook; one path serves both cases (the tests cover both).
//!
//! # What is read, and what is cached
//!
//! On every capture: the thread state (`PyGILState_GetThisThreadState`, which only reads a
//! thread-local), then per frame its code object pointer and instruction offset ([`RawFrame`]).
//! Names, files and line tables are read once per code object ([`CodeInfo`]) and cached by the
//! caller; a cached entry is checked against the object's name, file and line-table pointers
//! before use, so a code object freed and replaced at the same address is read again.
//!
//! Symbols come from the host process with `dlsym`; nothing is linked against Python, and a
//! process that is not CPython (or a version outside 3.10–3.13) has no Python stacks.

pub mod code_deaths;
mod known_code;
pub mod layout;
pub mod linetable;

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ops::Range;

use known_code::HIDDEN;
pub use known_code::KnownCode;
use layout::{FrameKind, Layout};
use linetable::{Format, LineTable};

/// Longest name or file name read from a string object.
const MAX_STRING: usize = 4096;
/// Longest line table read.
const MAX_LINETABLE: usize = 1 << 20;

/// One frame as found on the stack: a code object and the byte offset of its current
/// instruction (-1 before the first).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawFrame {
    /// The code object's address.
    pub code: usize,
    /// Byte offset into its bytecode.
    pub offset: i32,
}

/// What identifies a code object's contents, to tell a cached entry from a new object at the
/// same address.
pub type CodeCheck = [usize; 4];

/// What a code object says about itself.
#[derive(Debug, Clone)]
pub struct CodeInfo {
    /// Qualified name (3.11+) or name.
    pub name: String,
    /// `co_filename`.
    pub file: String,
    /// Lines by instruction offset.
    pub lines: LineTable,
    /// `co_firstlineno`, for frames that have not started.
    pub first_line: i32,
}

/// The running CPython, found in the host process.
#[derive(Debug)]
pub struct Python {
    layout: Layout,
    is_initialized: unsafe extern "C" fn() -> c_int,
    /// `Py_IsFinalizing` (3.13) or `_Py_IsFinalizing` (3.10–3.12), where present.
    is_finalizing: Option<unsafe extern "C" fn() -> c_int>,
    this_thread_state: unsafe extern "C" fn() -> *mut c_void,
    /// `&PyCode_Type`: every frame's code object is checked against it before it is read.
    code_type: usize,
}

/// Look up `name` in the host process.
pub(crate) fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `dlsym` with `RTLD_DEFAULT` and a NUL-terminated name only searches the loaded
    // objects.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!found.is_null()).then_some(found)
}

/// The calling thread's Python thread state ([`Python::thread_state`]), good for one walk in
/// the same hook.
#[derive(Clone, Copy, Debug)]
pub struct ThreadState(usize);

impl Python {
    /// Find the interpreter in this process. `Err` says why there are no Python stacks
    /// (`None` inside: not a Python process at all).
    pub fn detect() -> Result<Python, Option<String>> {
        let version = symbol(c"Py_GetVersion").ok_or(None)?;
        // SAFETY: `Py_GetVersion` has this signature in every CPython 3 and returns a static,
        // NUL-terminated string; it may be called before initialization and without the GIL.
        let version = unsafe {
            let f: unsafe extern "C" fn() -> *const c_char = std::mem::transmute(version);
            CStr::from_ptr(f()).to_string_lossy().into_owned()
        };
        let unsupported = || Some(format!("Python {version} is not supported (3.10–3.13)"));
        let mut numbers = version.split(|c: char| !c.is_ascii_digit());
        let major = numbers.next().and_then(|s| s.parse().ok());
        let minor = numbers.next().and_then(|s| s.parse().ok());
        let (Some(major), Some(minor)) = (major, minor) else {
            return Err(unsupported());
        };
        if version.contains("free-threading") {
            return Err(unsupported()); // a different object layout
        }
        let layout = layout::for_version(major, minor).ok_or_else(unsupported)?;
        let missing = |name: &str| Some(format!("Python {major}.{minor} has no symbol {name}"));
        let is_initialized =
            symbol(c"Py_IsInitialized").ok_or_else(|| missing("Py_IsInitialized"))?;
        let this_thread_state = symbol(c"PyGILState_GetThisThreadState")
            .ok_or_else(|| missing("PyGILState_GetThisThreadState"))?;
        let code_type = symbol(c"PyCode_Type").ok_or_else(|| missing("PyCode_Type"))?;
        // SAFETY: both are public C API functions with exactly these signatures, callable
        // without the GIL: they read a flag and a thread-local.
        let (is_initialized, this_thread_state) = unsafe {
            (
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(is_initialized),
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> *mut c_void>(
                    this_thread_state,
                ),
            )
        };
        let is_finalizing = symbol(c"Py_IsFinalizing")
            .or_else(|| symbol(c"_Py_IsFinalizing"))
            // SAFETY: both names are `int (void)` functions that read a runtime flag, callable
            // without the GIL.
            .map(|f| unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(f)
            });
        Ok(Python {
            layout,
            is_initialized,
            is_finalizing,
            this_thread_state,
            code_type: code_type as usize,
        })
    }

    /// Major and minor version.
    pub fn version(&self) -> (u32, u32) {
        self.layout.version
    }

    /// The calling thread's Python thread state; `None` for a thread Python never saw (or
    /// has let go of), or while the interpreter is not running.
    pub fn thread_state(&self) -> Option<ThreadState> {
        // SAFETY: the three are public C API functions, callable without the GIL (they read a
        // flag, a flag and a thread-local), found with these signatures by `detect`.
        unsafe {
            // During finalization other threads' states are being freed: no walk then.
            if (self.is_initialized)() == 0 || self.is_finalizing.is_some_and(|f| f() != 0) {
                return None;
            }
            let tstate = (self.this_thread_state)() as usize;
            plausible(tstate).then_some(ThreadState(tstate))
        }
    }

    /// The calling thread's Python frames, innermost first, those whose place among them is in
    /// `frames` given to `record` (none after its end is read); returns how many were found up
    /// to `frames`' end, those before its start too. `tstate` is the thread's state, from
    /// [`Python::thread_state`] in the same hook. Frames whose code object is one of `hidden`
    /// (0: an empty place) are left out, before anything is read of their code object. Two
    /// walks in the same hook, with the same `epoch` and `hidden`, give the same frames.
    ///
    /// `known` is the calling thread's [`KnownCode`] and `epoch` the code objects' deaths'
    /// epoch, read before the walk ([`code_deaths::epoch`]).
    #[inline(always)]
    pub fn walk(
        &self,
        tstate: ThreadState,
        frames: Range<usize>,
        known: &mut KnownCode,
        epoch: u64,
        hidden: &[usize; 4],
        record: impl FnMut(RawFrame),
    ) -> usize {
        known.begin(epoch, hidden);
        // A loop a version, whose offsets are constants (Note [The walk's loop]).
        match self.layout.version.1 {
            10 => self.walk_chain::<10>(tstate, frames.start, frames.end, known, hidden, record),
            11 => self.walk_chain::<11>(tstate, frames.start, frames.end, known, hidden, record),
            12 => self.walk_chain::<12>(tstate, frames.start, frames.end, known, hidden, record),
            _ => self.walk_chain::<13>(tstate, frames.start, frames.end, known, hidden, record),
        }
    }

    /// [`Python::walk`] for CPython 3.`MINOR` (the layout's version).
    ///
    /// # Note [The walk's loop]
    ///
    /// A capture walks the whole chain (~60 frames on a transformers model), so what a frame
    /// costs is most of what a capture costs. The loop is compiled once for each version, with
    /// that version's offsets as constants (they would otherwise be loaded, and spilled, a
    /// frame); a frame whose code object is the one the last walk met at its place
    /// ([`KnownCode`]) is answered by one compare, which also stands for the pointer's
    /// plausibility and for whether the code object's frames are hidden (the place keeps
    /// [`HIDDEN`] for those). Everything else about a code object is learned once, out of the
    /// loop ([`Python::learn`]).
    #[inline(always)]
    fn walk_chain<const MINOR: u32>(
        &self,
        tstate: ThreadState,
        skip: usize,
        max: usize,
        known: &mut KnownCode,
        hidden: &[usize; 4],
        mut record: impl FnMut(RawFrame),
    ) -> usize {
        let l = const {
            match layout::for_version(3, MINOR) {
                Some(layout) => layout,
                None => panic!("a supported version"),
            }
        };
        // SAFETY: see the module docs: the calling thread is parked in our hook, so its own
        // frame chain and the code objects it references stay as they are while we read; every
        // pointer is checked for null and alignment, every code object's type is checked before
        // its fields are read (or `known` says it was, in this epoch: Note [Known code
        // objects]), and the walk is bounded by `max`.
        unsafe {
            let mut frame = read_ptr(tstate.0 + l.tstate_frame);
            if l.kind == FrameKind::CFrame {
                if !plausible(frame) {
                    return 0;
                }
                frame = read_ptr(frame + l.cframe_current_frame);
            }
            let (mut n, mut place) = (0, 0);
            let links = 4 * max;
            while plausible(frame) && n < max && place < links {
                let code = read_ptr(frame + l.frame_code);
                let previous = read_ptr(frame + l.frame_previous);
                let first = match known.at(place, code) {
                    Some(first) => Some(first),
                    None => self.learn(code, place, known, hidden),
                };
                if let Some(first) = first
                    && first != HIDDEN
                    && let Some(offset) = Self::offset(&l, frame, code, first)
                {
                    if n >= skip {
                        record(RawFrame { code, offset });
                    }
                    n += 1;
                }
                place += 1;
                frame = previous;
            }
            n
        }
    }

    /// What the walk needs of the code object at `code`, met at the chain's `place`-th frame
    /// and not known there: its first traceable instruction, or [`HIDDEN`] for a code object
    /// of `hidden` (nothing is read of it then); read from the object (after its type is
    /// checked) unless the known table has it, and noted for the next walk. `None` when `code`
    /// is not a code object.
    ///
    /// # Safety
    ///
    /// `code` must be the code object pointer of a live frame of the calling thread.
    #[inline(never)]
    unsafe fn learn(
        &self,
        code: usize,
        place: usize,
        known: &mut KnownCode,
        hidden: &[usize; 4],
    ) -> Option<c_int> {
        if !plausible(code) {
            return None;
        }
        let first = match known.get(code) {
            Some(first) => first,
            None if hidden.contains(&code) => HIDDEN,
            None => {
                // SAFETY: as the caller guarantees: a live frame's code object pointer, whose
                // type is read (an object header) before anything else.
                unsafe {
                    if read_ptr(code + layout::OBJECT_TYPE) != self.code_type {
                        return None;
                    }
                    if self.layout.kind == FrameKind::FrameObject {
                        0
                    } else {
                        (code as *const u8)
                            .add(self.layout.code_firsttraceable)
                            .cast::<c_int>()
                            .read()
                            .max(0)
                    }
                }
            }
        };
        known.put(code, first);
        known.note_at(place, code, first);
        Some(first)
    }

    /// The offset of the frame at `frame`, running the code object at `code` whose first
    /// traceable instruction is `first`, or `None` for frames that are not (yet) running Python
    /// code.
    ///
    /// # Safety
    ///
    /// `frame` must point to a live frame of the calling thread (see [`Python::walk`]) of a
    /// chain laid out as `l`, whose code object `code` is.
    #[inline(always)]
    unsafe fn offset(l: &Layout, frame: usize, code: usize, first: c_int) -> Option<i32> {
        // SAFETY: as the caller guarantees: the fields read are the frame's own.
        unsafe {
            if l.kind == FrameKind::FrameObject {
                let lasti = (frame as *const u8).add(l.frame_instr).cast::<i32>().read();
                return Some(if lasti < 0 { -1 } else { lasti * 2 });
            }
            let owner = (frame as *const u8).add(l.frame_owner).read();
            if l.version.1 >= 12 && owner == layout::OWNED_BY_CSTACK {
                return None;
            }
            let bytecode = code + l.code_bytecode;
            let instr = read_ptr(frame + l.frame_instr);
            let first = bytecode + first as usize * layout::CODE_UNIT;
            if owner != layout::OWNED_BY_GENERATOR && instr < first {
                return None; // not started: CPython's own walkers skip it too
            }
            Some(i32::try_from(instr.wrapping_sub(bytecode) as isize).unwrap_or(-1))
        }
    }

    /// What identifies `code`'s contents.
    ///
    /// # Safety
    ///
    /// `code` must come from a [`RawFrame`] of the calling thread's current stack.
    pub unsafe fn check(&self, code: usize) -> CodeCheck {
        let l = &self.layout;
        // SAFETY: the caller guarantees a live code object (its type was checked by `walk`).
        unsafe {
            [
                read_ptr(code + l.code_filename),
                read_ptr(code + l.code_name),
                read_ptr(code + l.code_linetable),
                (code as *const u8)
                    .add(l.code_firstlineno)
                    .cast::<c_int>()
                    .read() as usize,
            ]
        }
    }

    /// Read `code`'s name, file and line table.
    ///
    /// # Safety
    ///
    /// As for [`Python::check`].
    pub unsafe fn describe(&self, code: usize) -> CodeInfo {
        let l = &self.layout;
        let format = if l.version >= (3, 11) {
            Format::Locations
        } else {
            Format::Pairs
        };
        // SAFETY: the caller guarantees a live code object, which keeps its name, file and line
        // table objects alive; strings and bytes are immutable.
        unsafe {
            let first_line = (code as *const u8)
                .add(l.code_firstlineno)
                .cast::<c_int>()
                .read();
            let table = read_bytes(read_ptr(code + l.code_linetable));
            CodeInfo {
                name: self.read_string(read_ptr(code + l.code_name)),
                file: self.read_string(read_ptr(code + l.code_filename)),
                lines: LineTable::decode(format, table, first_line),
                first_line,
            }
        }
    }

    /// A `str` object's text (`"?"` for forms a code object's strings never take).
    ///
    /// # Safety
    ///
    /// `object` must be null or a live `str` object.
    unsafe fn read_string(&self, object: usize) -> String {
        if !plausible(object) {
            return "?".into();
        }
        // SAFETY: the caller guarantees a live `str`; compact strings keep their characters
        // right after the header, `length` of them, each `kind` bytes wide.
        unsafe {
            let state = (object as *const u8)
                .add(layout::STRING_STATE)
                .cast::<u32>()
                .read();
            let length = (object as *const u8)
                .add(layout::STRING_LENGTH)
                .cast::<isize>()
                .read()
                .clamp(0, MAX_STRING as isize) as usize;
            let kind = (state >> 2) & 7;
            let compact = state & (1 << 5) != 0;
            let ascii = state & (1 << 6) != 0;
            if !compact {
                return "?".into();
            }
            let data = if ascii {
                object + self.layout.ascii_size
            } else {
                object + self.layout.compact_size
            };
            match kind {
                1 => std::slice::from_raw_parts(data as *const u8, length)
                    .iter()
                    .map(|&b| char::from(b))
                    .collect(),
                2 => {
                    String::from_utf16_lossy(std::slice::from_raw_parts(data as *const u16, length))
                }
                4 => std::slice::from_raw_parts(data as *const u32, length)
                    .iter()
                    .map(|&c| char::from_u32(c).unwrap_or('?'))
                    .collect(),
                _ => "?".into(),
            }
        }
    }
}

/// A pointer the walker may follow: non-null and aligned like an object.
fn plausible(address: usize) -> bool {
    address >= 4096 && address.is_multiple_of(8)
}

/// # Safety
///
/// `address` must be readable and aligned for a pointer.
unsafe fn read_ptr(address: usize) -> usize {
    // SAFETY: as the caller guarantees.
    unsafe { (address as *const usize).read() }
}

/// A `bytes` object's contents (empty for null).
///
/// # Safety
///
/// `object` must be null or a live `bytes` object that outlives the returned slice's use.
unsafe fn read_bytes<'a>(object: usize) -> &'a [u8] {
    if !plausible(object) {
        return &[];
    }
    // SAFETY: as the caller guarantees; a `bytes` object holds `ob_size` bytes at `ob_sval`.
    unsafe {
        let size = (object as *const u8)
            .add(layout::VAR_SIZE)
            .cast::<isize>()
            .read()
            .clamp(0, MAX_LINETABLE as isize) as usize;
        std::slice::from_raw_parts((object + layout::BYTES_DATA) as *const u8, size)
    }
}
