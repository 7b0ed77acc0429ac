//! `cachealloc leaks` and `cachealloc peak`: live blocks at a moment, grouped by stack.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use crate::format::{bytes, percent, seconds};
use crate::walk::{TraceWalk, frame_label, stack_frames};
use crate::{Error, one_trace};

/// The arguments of `cachealloc leaks` and `cachealloc peak`.
#[derive(clap::Args, Debug)]
pub struct GroupsArgs {
    /// Trace directory.
    pub trace: PathBuf,
    /// Stacks to list.
    #[arg(long, default_value_t = 20)]
    pub top: usize,
}

/// Print the blocks allocated (not pending) in `replay`'s state, grouped by stack, largest
/// first: per group its bytes, share, block count and the stack.
fn by_stack(walk: &TraceWalk, top: usize, out: &mut dyn Write) -> Result<(), Error> {
    let state = &walk.state;
    let mut groups: HashMap<(u32, u32), (u64, u64)> = HashMap::new();
    let mut total = 0;
    for b in state.blocks.values().filter(|b| b.pending == 0) {
        let g = groups.entry((b.device, b.stack)).or_default();
        g.0 += b.size;
        g.1 += 1;
        total += b.size;
    }
    let mut groups: Vec<_> = groups.into_iter().collect();
    groups.sort_by(|a, b| b.1.0.cmp(&a.1.0).then(a.0.cmp(&b.0)));
    writeln!(
        out,
        "{} in {} blocks, {} stacks",
        bytes(total),
        groups.iter().map(|g| g.1.1).sum::<u64>(),
        groups.len()
    )?;
    for ((device, stack), (size, count)) in groups.iter().take(top) {
        writeln!(out)?;
        writeln!(
            out,
            "{} ({}) in {count} block{} on device {device}, stack {stack}:",
            bytes(*size),
            percent(*size, total),
            if *count == 1 { "" } else { "s" }
        )?;
        let frames = stack_frames(state, *stack);
        if frames.is_empty() {
            writeln!(out, "    (no stack recorded)")?;
        }
        for f in frames {
            writeln!(out, "    {}", frame_label(f))?;
        }
    }
    if groups.len() > top {
        let rest: u64 = groups[top..].iter().map(|g| g.1.0).sum();
        writeln!(out)?;
        writeln!(
            out,
            "... {} more stacks holding {}",
            groups.len() - top,
            bytes(rest)
        )?;
    }
    Ok(())
}

/// `leaks`: what is still allocated at the end.
pub fn leaks(args: &GroupsArgs, out: &mut dyn Write) -> Result<(), Error> {
    let dir = one_trace(&args.trace)?;
    let mut walk = TraceWalk::open(&dir)?;
    walk.run_through(u64::MAX)?;
    writeln!(out, "allocated at the end ({}):", seconds(walk.t))?;
    by_stack(&walk, args.top, out)
}

/// `peak`: what was allocated when allocated memory peaked, per device.
pub fn peak(args: &GroupsArgs, out: &mut dyn Write) -> Result<(), Error> {
    let dir = one_trace(&args.trace)?;
    let scan = crate::analysis::scan(&dir, &crate::progress::Progress::new("scanning"))?;
    for (i, (device, d)) in scan.devices.iter().enumerate() {
        if i > 0 {
            writeln!(out)?;
        }
        let mut walk = TraceWalk::open(&dir)?;
        walk.run_through(d.peak_allocated.index)?;
        // Only this device's blocks.
        walk.state.blocks.retain(|(dev, _), _| dev == device);
        writeln!(
            out,
            "device {device}: peak allocated {} at {}:",
            bytes(d.peak_allocated.bytes),
            seconds(d.peak_allocated.t)
        )?;
        by_stack(&walk, args.top, out)?;
    }
    Ok(())
}
