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
pub mod layout;
pub mod linetable;

use std::ffi::{CStr, c_char, c_int, c_void};

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

/// The code objects a thread's captures have found on its stack, with where each one's
/// traceable bytecode starts: a frame whose code object is known costs no read of it.
///
/// # Note [Known code objects]
///
/// A frame's code object is read twice per capture: its type (is it a code object at all?)
/// and its first traceable instruction (has the frame started?). Both lie in the code object,
/// two cache lines that a training step has long evicted between two allocations: on the
/// Llama's ~60-frame stacks they were among the capture's hottest misses. Their answers never
/// change while the object lives, so each thread keeps them by address, in a small table it
/// alone touches.
///
/// An address names one code object only while it lives, and the table is trusted only while
/// no code object has died: it belongs to one epoch of [Note [Code objects' deaths]](code_deaths),
/// read before the walk, and is emptied when a capture reads another. That suffices: an entry
/// was made, during this epoch, from a live frame's code object; if that object had died since,
/// its death would have ended the epoch. Where deaths are not heard (epoch 0: Python before
/// 3.12) the table is not used.
///
/// Most of a walk's frames are where the thread's last walk found them (the outer ones do not
/// change between two allocations), so each place in the chain also remembers the code object
/// the last walk met there: a frame whose code object is that one is answered by the next entry
/// of a short array, without the table's hash and its scattered line. Both belong to the epoch.
#[derive(Debug)]
pub struct KnownCode {
    /// The epoch the entries belong to (0: none, and none are made).
    epoch: u64,
    /// `(code object's address, its first traceable instruction)`, by a hash of the address
    /// (direct-mapped: a collision replaces the older entry).
    slots: Box<[(usize, c_int)]>,
    /// The last walk's `(code object, first traceable instruction)` by place in the chain,
    /// innermost first.
    last_walk: Vec<(usize, c_int)>,
    /// The hidden code objects the entries were made with ([`HIDDEN`]).
    hidden: [usize; 4],
}

impl Default for KnownCode {
    fn default() -> Self {
        KnownCode {
            epoch: 0,
            slots: vec![(0, 0); KnownCode::SLOTS].into_boxed_slice(),
            last_walk: Vec::new(),
            hidden: [0; 4],
        }
    }
}

impl KnownCode {
    /// Entries: 8 KiB a thread, more than the code objects a model's stacks run through.
    const SLOTS: usize = 512;

    /// Before a walk in `epoch` with the code objects of `hidden` hidden: forget the entries
    /// of another epoch, or of another set of hidden code objects (it only grows, and rarely:
    /// the Python integration hides its wrappers once).
    pub fn begin(&mut self, epoch: u64, hidden: &[usize; 4]) {
        if epoch != self.epoch || *hidden != self.hidden {
            self.slots.fill((0, 0));
            self.last_walk.clear();
            self.epoch = epoch;
            self.hidden = *hidden;
        }
    }

    /// The first traceable instruction of `code` if the last walk met it at the chain's
    /// `place`-th frame (in this epoch: in epoch 0 no place is remembered).
    #[inline(always)]
    fn at(&self, place: usize, code: usize) -> Option<c_int> {
        match self.last_walk.get(place) {
            Some(&(known, first)) if known == code => Some(first),
            _ => None,
        }
    }

    /// What the chain's `place`-th frame's code object `code` was found to be, for the next
    /// walk.
    fn note_at(&mut self, place: usize, code: usize, first: c_int) {
        if self.epoch == 0 {
            return;
        }
        if place < self.last_walk.len() {
            self.last_walk[place] = (code, first);
        } else if place == self.last_walk.len() {
            self.last_walk.push((code, first));
        }
    }

    fn slot(code: usize) -> usize {
        ((code as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 55) as usize % Self::SLOTS
    }

    /// The first traceable instruction of the code object at `code`, if known in this epoch.
    fn get(&self, code: usize) -> Option<c_int> {
        if self.epoch == 0 {
            return None;
        }
        let (address, first) = self.slots[Self::slot(code)];
        (address == code).then_some(first)
    }

    /// `code` is a code object whose first traceable instruction is `first`.
    fn put(&mut self, code: usize, first: c_int) {
        if self.epoch != 0 {
            self.slots[Self::slot(code)] = (code, first);
        }
    }
}

/// What [`KnownCode`] keeps, instead of a first traceable instruction, for a code object whose
/// frames stacks leave out.
const HIDDEN: c_int = -1;

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

    /// The calling thread's Python frames, innermost first, into `out`; returns how many.
    /// `tstate` is the thread's state, from [`Python::thread_state`] in the same hook. Frames
    /// whose code object is one of `hidden` (0: an empty place) are left out, before anything
    /// is read of their code object.
    ///
    /// `known` is the calling thread's [`KnownCode`] and `epoch` the code objects' deaths'
    /// epoch, read before the walk ([`code_deaths::epoch`]).
    pub fn walk(
        &self,
        tstate: ThreadState,
        out: &mut [RawFrame],
        known: &mut KnownCode,
        epoch: u64,
        hidden: &[usize; 4],
    ) -> usize {
        known.begin(epoch, hidden);
        // A loop a version, whose offsets are constants (Note [The walk's loop]).
        match self.layout.version.1 {
            10 => self.walk_chain::<10>(tstate, out, known, hidden),
            11 => self.walk_chain::<11>(tstate, out, known, hidden),
            12 => self.walk_chain::<12>(tstate, out, known, hidden),
            _ => self.walk_chain::<13>(tstate, out, known, hidden),
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
        out: &mut [RawFrame],
        known: &mut KnownCode,
        hidden: &[usize; 4],
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
        // objects]), and the walk is bounded by `out`'s length.
        unsafe {
            let mut frame = read_ptr(tstate.0 + l.tstate_frame);
            if l.kind == FrameKind::CFrame {
                if !plausible(frame) {
                    return 0;
                }
                frame = read_ptr(frame + l.cframe_current_frame);
            }
            let (mut n, mut place) = (0, 0);
            let links = 4 * out.len();
            while plausible(frame) && n < out.len() && place < links {
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
                    out[n] = RawFrame { code, offset };
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

#[cfg(test)]
mod tests {
    use super::KnownCode;

    #[test]
    fn known_code_objects_belong_to_one_epoch() {
        let mut known = KnownCode::default();
        // Deaths not heard: nothing is kept.
        known.begin(0, &[0; 4]);
        known.put(0x7f00_0000_1000, 3);
        assert_eq!(known.get(0x7f00_0000_1000), None);
        // Within an epoch an entry stays; another epoch forgets it.
        known.begin(5, &[0; 4]);
        known.put(0x7f00_0000_1000, 3);
        known.begin(5, &[0; 4]);
        assert_eq!(known.get(0x7f00_0000_1000), Some(3));
        assert_eq!(known.get(0x7f00_0000_2000), None);
        known.begin(6, &[0; 4]);
        assert_eq!(known.get(0x7f00_0000_1000), None);
        // So does another set of hidden code objects.
        known.put(0x7f00_0000_1000, 3);
        known.begin(6, &[0x7f00_0000_9000, 0, 0, 0]);
        assert_eq!(known.get(0x7f00_0000_1000), None);
    }

    #[test]
    fn a_colliding_address_replaces_the_entry_and_never_reads_another_objects() {
        let mut known = KnownCode::default();
        known.begin(1, &[0; 4]);
        let first = 0x7f00_0000_1000usize;
        let other = (1..)
            .map(|i| first + 16 * i)
            .find(|&a| KnownCode::slot(a) == KnownCode::slot(first))
            .expect("a colliding address");
        known.put(first, 1);
        known.put(other, 2);
        assert_eq!(known.get(other), Some(2));
        assert_eq!(known.get(first), None);
    }

    #[test]
    fn a_place_remembers_its_last_code_object_within_the_epoch() {
        let mut known = KnownCode::default();
        known.begin(1, &[0; 4]);
        let (a, b) = (0x7f00_0000_1000usize, 0x7f00_0000_2000usize);
        // Learned at place 0 and 1 by the first walk.
        known.put(a, 3);
        known.note_at(0, a, 3);
        known.put(b, 4);
        known.note_at(1, b, 4);
        // Evict `a` from the table: the place still answers for it, and only for it.
        let colliding = (1..)
            .map(|i| a + 16 * i)
            .find(|&c| KnownCode::slot(c) == KnownCode::slot(a))
            .expect("a colliding address");
        known.put(colliding, 9);
        assert_eq!(known.get(a), None, "gone from the table");
        assert_eq!(known.at(0, a), Some(3), "the last walk's at place 0");
        assert_eq!(known.at(1, a), None, "place 1 had another one");
        assert_eq!(known.at(2, b), None, "a place not yet reached");
        known.note_at(2, b, 4);
        assert_eq!(known.at(2, b), Some(4));
        // A place takes the code object met there last.
        known.note_at(0, b, 4);
        assert_eq!(known.at(0, a), None);
        assert_eq!(known.at(0, b), Some(4));
        // Another epoch forgets the places too; epoch 0 keeps none.
        known.begin(2, &[0; 4]);
        assert_eq!(known.at(0, b), None);
        assert_eq!(known.at(1, b), None);
        known.begin(0, &[0; 4]);
        known.note_at(0, a, 3);
        assert_eq!(known.at(0, a), None, "no place is kept in epoch 0");
    }
}
