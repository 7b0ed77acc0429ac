//! Native stack capture (`stacks:native` or `stacks:all`).
//!
//! On the hot path only raw return addresses are taken (`backtrace::trace_unsynchronized`, at
//! most `stack_depth` frames, skipping the frames inside this library). The address list is then
//! interned: a stack seen before costs a hash lookup; a new one gets an id, and the definitions of
//! its new frames and of the stack itself are sent to the trace *before* the id is first used
//! (they are sent under the interner's lock, so any other thread that finds the stack interned
//! sends its events after them). The recorder's worker resolves frame names, files and lines off
//! the hot path.
//!
//! Python stacks (`stacks:python`) are not built yet.

use std::collections::HashMap;
use std::sync::Mutex;

use cachealloc_recorder::Record;
use cachealloc_recorder::schema::{FRAME_NATIVE, FrameDef, StackDef};

use crate::trace::Trace;

/// Deepest stack captured, whatever `stack_depth` says.
const MAX_DEPTH: usize = 256;

#[derive(Debug, Default)]
struct Interner {
    stacks: HashMap<Vec<u64>, u32>,
    frames: HashMap<u64, u32>,
}

/// Captures and interns native stacks.
#[derive(Debug)]
pub struct Stacks {
    depth: usize,
    /// Address range of this library's code: its frames are not the application's.
    own_code: (u64, u64),
    interner: Mutex<Interner>,
}

impl Stacks {
    /// Capture up to `depth` frames per stack.
    pub fn new(depth: usize) -> Stacks {
        Stacks {
            depth: depth.clamp(1, MAX_DEPTH),
            own_code: own_code_range(),
            interner: Mutex::default(),
        }
    }

    /// The calling thread's stack as an id (0 if it has no frame outside this library),
    /// sending the definitions of anything new to `trace` first.
    pub fn capture(&self, trace: &Trace) -> u32 {
        let mut ips = [0u64; MAX_DEPTH];
        let mut n = 0;
        let (own_start, own_end) = self.own_code;
        // SAFETY: on Linux the unwinder behind `trace_unsynchronized` (`_Unwind_Backtrace`) is
        // thread-safe; the crate's lock, which the synchronized `trace` adds, only matters for
        // unwinders that are not (Windows' dbghelp). The callback only copies addresses.
        unsafe {
            backtrace::trace_unsynchronized(|frame| {
                let ip = frame.ip() as u64;
                if ip == 0 {
                    return false;
                }
                if !(own_start..own_end).contains(&ip) {
                    ips[n] = ip;
                    n += 1;
                }
                n < self.depth
            });
        }
        if n == 0 {
            return 0;
        }
        let key = &ips[..n];
        let mut interner = self.interner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&id) = interner.stacks.get(key) {
            return id;
        }
        let mut frames = Vec::with_capacity(n);
        for &ip in key {
            let next = interner.frames.len() as u32 + 1;
            let id = *interner.frames.entry(ip).or_insert_with(|| {
                trace.send(Record::FrameDef(Box::new(FrameDef {
                    id: next,
                    kind: FRAME_NATIVE,
                    name: String::new(),
                    file: String::new(),
                    line: 0,
                    address: ip,
                })));
                next
            });
            frames.push(id);
        }
        let id = interner.stacks.len() as u32 + 1;
        trace.send(Record::StackDef(Box::new(StackDef { id, frames })));
        interner.stacks.insert(key.to_vec(), id);
        id
    }
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
