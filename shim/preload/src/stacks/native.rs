//! Native stacks: the calling thread's return addresses.
//!
//! # Why not `_Unwind_Backtrace`
//!
//! The system unwinder (libgcc's `_Unwind_Backtrace`, behind `backtrace::trace_unsynchronized`)
//! finds and interprets the DWARF unwind rules (`.eh_frame`) of every frame anew: about 180 ns
//! per frame, 11–12 µs for the 64 frames of an allocation made from Python. On x86-64 Linux we
//! use `framehop` instead, which caches the rule of each return address: after warm-up a frame
//! costs a cache lookup and a stack read.
//!
//! # How
//!
//! * **Modules** are enumerated with `dl_iterate_phdr`: each loaded object's executable segment,
//!   and its `.eh_frame_hdr` (the `PT_GNU_EH_FRAME` segment) and `.eh_frame` (found through the
//!   header), read in place. Each object is pinned with `dlopen(RTLD_NOLOAD)` first, so it can
//!   never be unloaded while we hold slices of it. Objects loaded later are picked up when a
//!   stack reaches an address no known module covers.
//! * **Registers**: the instruction, stack and frame pointers are read at the capture point;
//!   the capture function's own unwind rules take it from there.
//! * **Stack reads** are bounded to the calling thread's stack (from `pthread_getattr_np`,
//!   once per thread), so a wrong rule ends the walk instead of reading wild memory.
//! * The **rule cache** is per thread (no lock on the hot path but a read lock on the module
//!   list).
//!
//! Elsewhere (other architectures), and with `unwinder:system` in the configuration (a diagnostic
//! switch, used by a test that compares both), the system unwinder is used.

use std::ops::Range;

/// Captures native stacks.
#[derive(Debug)]
pub struct NativeStacks {
    /// Address range of this library's code: its frames are not the application's.
    own_code: (u64, u64),
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fast: Option<fast::Unwinder>,
}

impl Default for NativeStacks {
    fn default() -> NativeStacks {
        NativeStacks::new(false)
    }
}

impl NativeStacks {
    /// Set up: find this library's code, and (on x86-64 Linux, unless `use_system`: the
    /// configuration's `unwinder:system`) the loaded modules.
    pub fn new(use_system: bool) -> NativeStacks {
        NativeStacks {
            own_code: own_code_range(),
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            fast: (!use_system).then(fast::Unwinder::new),
        }
    }

    /// Return addresses of the calling thread outside this library, innermost first, into
    /// `ips`; returns how many.
    #[inline(never)]
    pub fn capture(&self, ips: &mut [u64]) -> usize {
        let own = self.own_code.0..self.own_code.1;
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if let Some(fast) = &self.fast {
            return fast.capture(ips, &own);
        }
        capture_system(ips, &own)
    }
}

/// The system unwinder (`_Unwind_Backtrace`).
fn capture_system(ips: &mut [u64], own: &Range<u64>) -> usize {
    let mut n = 0;
    if ips.is_empty() {
        return 0;
    }
    // SAFETY: on Linux the unwinder behind `trace_unsynchronized` (`_Unwind_Backtrace`) is
    // thread-safe; the crate's lock, which the synchronized `trace` adds, only matters for
    // unwinders that are not (Windows' dbghelp). The callback only copies addresses.
    unsafe {
        backtrace::trace_unsynchronized(|frame| {
            let ip = frame.ip() as u64;
            if ip == 0 {
                return false;
            }
            if !own.contains(&ip) {
                ips[n] = ip;
                n += 1;
            }
            n < ips.len()
        });
    }
    n
}

/// The address range of the executable mappings of the file this function lives in.
fn own_code_range() -> (u64, u64) {
    let here = own_code_range as *const () as usize as u64;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return (0, 0);
    };
    let parse = |line: &str| -> Option<(u64, u64, String, bool)> {
        let mut parts = line.split_whitespace();
        let (start, end) = parts.next()?.split_once('-')?;
        let perms = parts.next()?;
        let path = parts.nth(3).unwrap_or("").to_string();
        Some((
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
            path,
            perms.contains('x'),
        ))
    };
    let entries: Vec<_> = maps.lines().filter_map(parse).collect();
    let Some(path) = entries
        .iter()
        .find(|(s, e, _, _)| (*s..*e).contains(&here))
        .map(|e| e.2.clone())
    else {
        return (0, 0);
    };
    let own = entries.iter().filter(|e| e.2 == path && e.3);
    let start = own.clone().map(|e| e.0).min().unwrap_or(0);
    let end = own.map(|e| e.1).max().unwrap_or(0);
    (start, end)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod fast {
    use std::cell::RefCell;
    use std::ffi::{CStr, c_int, c_void};
    use std::ops::Range;
    use std::sync::RwLock;

    use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
    use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _};

    /// Unwind data of a loaded object, read in place (the object is pinned: see the module
    /// docs).
    type Bytes = &'static [u8];

    /// The modules known so far.
    #[derive(Default)]
    struct Modules {
        unwinder: UnwinderX86_64<Bytes>,
        /// Executable ranges of the registered modules.
        code: Vec<Range<u64>>,
        /// Pages that stayed uncovered after a refresh (code without a module, such as JIT
        /// code): a walk ending there does not enumerate the objects again.
        uncovered: std::collections::HashSet<u64>,
    }

    impl Modules {
        fn covers(&self, address: u64) -> bool {
            self.code.iter().any(|r| r.contains(&address))
        }
    }

    /// framehop over the process's modules.
    pub struct Unwinder {
        modules: RwLock<Modules>,
    }

    impl std::fmt::Debug for Unwinder {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("framehop unwinder")
        }
    }

    thread_local! {
        /// This thread's rule cache, and its stack's address range.
        static THREAD: RefCell<Option<(Box<CacheX86_64>, Range<u64>)>> = const { RefCell::new(None) };
    }

    impl Unwinder {
        pub fn new() -> Unwinder {
            let unwinder = Unwinder {
                modules: RwLock::new(Modules::default()),
            };
            unwinder.refresh();
            unwinder
        }

        /// Register the loaded objects not registered yet.
        fn refresh(&self) {
            let found = loaded_objects();
            let mut modules = self.modules.write().unwrap_or_else(|p| p.into_inner());
            for object in found {
                if modules.code.contains(&object.code) {
                    continue;
                }
                modules.code.push(object.code.clone());
                modules.unwinder.add_module(object.module);
            }
        }

        pub fn capture(&self, ips: &mut [u64], own: &Range<u64>) -> usize {
            if ips.is_empty() {
                return 0;
            }
            let (mut n, stopped_at) = self.walk(ips, own);
            // A stack that ran into code no module covers: something may have been loaded
            // since; pick it up and walk again (once per unknown page).
            if let Some(address) = stopped_at {
                let page = address >> 12;
                let unknown = {
                    let m = self.modules.read().unwrap_or_else(|p| p.into_inner());
                    !m.covers(address) && !m.uncovered.contains(&page)
                };
                if unknown {
                    self.refresh();
                    let mut m = self.modules.write().unwrap_or_else(|p| p.into_inner());
                    if !m.covers(address) && m.uncovered.len() < 4096 {
                        m.uncovered.insert(page);
                    }
                    drop(m);
                    n = self.walk(ips, own).0;
                }
            }
            n
        }

        /// Walk the stack; also returns the last address seen when the walk ended on an error.
        #[inline(never)]
        fn walk(&self, ips: &mut [u64], own: &Range<u64>) -> (usize, Option<u64>) {
            let (pc, sp, bp): (u64, u64, u64);
            // SAFETY: reads the instruction, stack and frame pointers into registers; touches
            // no memory and leaves the stack and flags as they were.
            unsafe {
                std::arch::asm!(
                    "lea {pc}, [rip]",
                    "mov {sp}, rsp",
                    "mov {bp}, rbp",
                    pc = out(reg) pc,
                    sp = out(reg) sp,
                    bp = out(reg) bp,
                    options(nomem, nostack, preserves_flags),
                );
            }
            let modules = self.modules.read().unwrap_or_else(|p| p.into_inner());
            // `try_with`: during thread teardown the thread-local may be gone; then the system
            // unwinder takes over.
            let walked = THREAD.try_with(|cell| {
                let mut slot = cell.borrow_mut();
                let (cache, stack) =
                    slot.get_or_insert_with(|| (Box::new(CacheX86_64::new()), thread_stack(sp)));
                let stack = stack.clone();
                let mut read_stack = |address: u64| -> Result<u64, ()> {
                    if !address.is_multiple_of(8)
                        || address < stack.start
                        || address + 8 > stack.end
                    {
                        return Err(());
                    }
                    // SAFETY: the address is aligned and inside this thread's own stack, which
                    // is mapped for the thread's lifetime; the frames above us are live.
                    Ok(unsafe { (address as *const u64).read() })
                };
                let regs = UnwindRegsX86_64::new(pc, sp, bp);
                let mut frames = modules
                    .unwinder
                    .iter_frames(pc, regs, cache, &mut read_stack);
                let mut n = 0;
                let mut last = pc;
                loop {
                    match frames.next() {
                        Ok(Some(frame)) => {
                            let ip = match frame {
                                FrameAddress::InstructionPointer(ip) => ip,
                                FrameAddress::ReturnAddress(ra) => ra.get(),
                            };
                            last = ip;
                            if own.contains(&ip) {
                                continue;
                            }
                            ips[n] = ip;
                            n += 1;
                            if n == ips.len() {
                                return (n, None);
                            }
                        }
                        Ok(None) => return (n, None),
                        Err(_) => return (n, Some(last)),
                    }
                }
            });
            walked.unwrap_or_else(|_| (super::capture_system(ips, own), None))
        }
    }

    /// The calling thread's stack, from `pthread_getattr_np`; a 64 MiB window above `sp` if
    /// that fails.
    fn thread_stack(sp: u64) -> Range<u64> {
        let fallback = sp..sp.saturating_add(64 << 20);
        // SAFETY: `attr` is initialized by `pthread_getattr_np` before it is read and destroyed
        // after; the out-pointers point to locals.
        unsafe {
            let mut attr: libc::pthread_attr_t = std::mem::zeroed();
            if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
                return fallback;
            }
            let mut base: *mut c_void = std::ptr::null_mut();
            let mut size: libc::size_t = 0;
            let ok = libc::pthread_attr_getstack(&attr, &mut base, &mut size) == 0;
            libc::pthread_attr_destroy(&mut attr);
            if !ok || base.is_null() {
                return fallback;
            }
            let range = base as u64..base as u64 + size as u64;
            if range.contains(&sp) { range } else { fallback }
        }
    }

    /// A loaded object ready to register.
    struct Object {
        code: Range<u64>,
        module: Module<Bytes>,
    }

    /// Every loaded object with executable code and unwind tables, each pinned.
    fn loaded_objects() -> Vec<Object> {
        let mut out: Vec<Object> = vec![];
        unsafe extern "C" fn each(
            info: *mut libc::dl_phdr_info,
            _size: libc::size_t,
            data: *mut c_void,
        ) -> c_int {
            // SAFETY: the loader passes a valid `dl_phdr_info` for the duration of the call,
            // and `data` is the `Vec` passed below.
            unsafe {
                let out = &mut *(data as *mut Vec<Object>);
                if let Some(object) = object_of(&*info) {
                    out.push(object);
                }
            }
            0
        }
        // SAFETY: `each` matches the callback type and only uses `data` as the `Vec` it is.
        unsafe {
            libc::dl_iterate_phdr(Some(each), &mut out as *mut Vec<Object> as *mut c_void);
        }
        out
    }

    /// The unwind data of one loaded object (`None` without code or `.eh_frame_hdr`, or when it
    /// cannot be pinned).
    ///
    /// # Safety
    ///
    /// `info` must be the loader's description of a loaded object, inside `dl_iterate_phdr`.
    unsafe fn object_of(info: &libc::dl_phdr_info) -> Option<Object> {
        // SAFETY: as the caller guarantees: `dlpi_phdr` points to `dlpi_phnum` headers and
        // `dlpi_name` to a NUL-terminated string; the segments they describe are mapped.
        unsafe {
            let base = info.dlpi_addr;
            let headers = std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize);
            let name = if info.dlpi_name.is_null() {
                String::new()
            } else {
                CStr::from_ptr(info.dlpi_name)
                    .to_string_lossy()
                    .into_owned()
            };
            // Pin named objects so their memory outlives our slices (the main program and the
            // vDSO cannot be unloaded).
            if !name.is_empty() && !name.contains("linux-vdso") {
                let handle = libc::dlopen(info.dlpi_name, libc::RTLD_LAZY | libc::RTLD_NOLOAD);
                if handle.is_null() {
                    return None;
                }
            }
            let loads = || headers.iter().filter(|h| h.p_type == libc::PT_LOAD);
            let code_headers = loads().filter(|h| h.p_flags & libc::PF_X != 0);
            let code_start = code_headers.clone().map(|h| h.p_vaddr).min()?;
            let code_end = code_headers.map(|h| h.p_vaddr + h.p_memsz).max()?;
            let hdr = headers.iter().find(|h| h.p_type == libc::PT_GNU_EH_FRAME)?;
            let hdr_svma = hdr.p_vaddr..hdr.p_vaddr + hdr.p_memsz;
            let hdr_bytes: Bytes =
                std::slice::from_raw_parts((base + hdr.p_vaddr) as *const u8, hdr.p_memsz as usize);
            let eh_frame_start = eh_frame_address(hdr_bytes, hdr.p_vaddr)?;
            // `.eh_frame` runs to a zero terminator; its segment's end bounds it.
            let segment =
                loads().find(|h| (h.p_vaddr..h.p_vaddr + h.p_memsz).contains(&eh_frame_start))?;
            let eh_frame_end = segment.p_vaddr + segment.p_memsz;
            let eh_frame: Bytes = std::slice::from_raw_parts(
                (base + eh_frame_start) as *const u8,
                (eh_frame_end - eh_frame_start) as usize,
            );
            let info = ExplicitModuleSectionInfo {
                base_svma: 0,
                text_svma: Some(code_start..code_end),
                eh_frame_svma: Some(eh_frame_start..eh_frame_end),
                eh_frame: Some(eh_frame),
                eh_frame_hdr_svma: Some(hdr_svma),
                eh_frame_hdr: Some(hdr_bytes),
                ..Default::default()
            };
            let code = base + code_start..base + code_end;
            Some(Object {
                code: code.clone(),
                module: Module::new(name, code, base, info),
            })
        }
    }

    /// Where `.eh_frame` starts (as a stated address), from `.eh_frame_hdr` at `hdr_svma`.
    fn eh_frame_address(hdr: &[u8], hdr_svma: u64) -> Option<u64> {
        let (&version, &encoding) = (hdr.first()?, hdr.get(1)?);
        if version != 1 {
            return None;
        }
        let field = hdr_svma + 4; // after version and the three encodings
        let value: i64 = match encoding & 0x0f {
            0x03 => u32::from_le_bytes(hdr.get(4..8)?.try_into().ok()?).into(),
            0x0b => i32::from_le_bytes(hdr.get(4..8)?.try_into().ok()?).into(),
            0x00 | 0x04 | 0x0c => i64::from_le_bytes(hdr.get(4..12)?.try_into().ok()?),
            _ => return None,
        };
        match encoding & 0x70 {
            0x00 => Some(value as u64),
            0x10 => Some(field.wrapping_add(value as u64)), // pc-relative
            0x30 => Some(hdr_svma.wrapping_add(value as u64)), // relative to the header
            _ => None,
        }
    }
}
