//! `cachealloc run [--conf ...] -- CMD ARGS...`: run a command under the shim, forward its exit
//! code, then summarize the trace it left.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::Error;

/// `cachealloc run`'s arguments.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Allocator settings (CACHEALLOC_CONF), e.g. max_split_size_mb:256,stacks:all.
    #[arg(long)]
    pub conf: Option<String>,
    /// Where the trace goes (default: ./cachealloc-trace).
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
    /// libcachealloc.so to preload (default: the one installed next to this binary).
    #[arg(long)]
    pub lib: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    pub command: Vec<String>,
}

/// Where `libcachealloc.so` is: `--lib`, else next to this binary (`bin/../lib/` or the same
/// directory, as `cargo build` leaves it).
pub(crate) fn library(lib: Option<PathBuf>) -> Result<PathBuf, Error> {
    if let Some(lib) = lib {
        return Ok(lib);
    }
    let exe = std::env::current_exe().map_err(|e| Error::Message(format!("own path: {e}")))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidates = [
        dir.join("libcachealloc.so"),
        dir.join("../lib/libcachealloc.so"),
    ];
    candidates
        .iter()
        .find(|p| p.exists())
        .map(|p| p.canonicalize().unwrap_or_else(|_| p.clone()))
        .ok_or_else(|| {
            Error::Message(format!(
                "libcachealloc.so is not next to {} (looked in {}); pass --lib",
                exe.display(),
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

/// Run the command.
pub fn run(args: &RunArgs, out: &mut dyn Write) -> Result<ExitCode, Error> {
    let command = &args.command;
    let lib = library(args.lib.clone())?;
    let trace_root = args
        .trace_dir
        .clone()
        .unwrap_or_else(|| "cachealloc-trace".into());
    let trace_root = std::path::absolute(&trace_root).unwrap_or(trace_root);
    let mut conf = args.conf.clone().unwrap_or_default();
    if !conf.is_empty() {
        conf.push(',');
    }
    conf.push_str(&format!("trace_dir:{}", trace_root.display()));
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(existing) if !existing.is_empty() => format!("{}:{existing}", lib.display()),
        _ => lib.display().to_string(),
    };
    let before: Vec<PathBuf> = list(&trace_root);
    let status = std::process::Command::new(&command[0])
        .args(&command[1..])
        .env("LD_PRELOAD", preload)
        .env("CACHEALLOC_CONF", &conf)
        .status()
        .map_err(|e| Error::Message(format!("{}: {e}", command[0])))?;
    let new: Vec<PathBuf> = list(&trace_root)
        .into_iter()
        .filter(|d| !before.contains(d))
        .collect();
    if new.is_empty() {
        writeln!(
            out,
            "cachealloc: no trace was written under {} (the command made no CUDA allocation, or ran with trace:off)",
            trace_root.display()
        )?;
    } else {
        writeln!(out)?;
        super::summary::run(&super::summary::SummaryArgs { traces: new }, out)?;
    }
    let code = status.code().unwrap_or_else(|| {
        use std::os::unix::process::ExitStatusExt;
        128 + status.signal().unwrap_or(0)
    });
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

fn list(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}
