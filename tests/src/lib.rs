//! Helpers for cachealloc's end-to-end tests, shared by every file of `tests/`: run a program
//! under `LD_PRELOAD=libcachealloc.so` over fakecuda ([`Run`]), capture what it did
//! ([`Output`]: its exit, the numbers it printed, fakecuda's report, its trace) and read traces
//! ([`read_trace`], [`count`], [`alloc_stacks`]); [`traced`] and [`cachealloc_binary`] for the
//! tests of the `cachealloc` tools.
//!
//! The build script compiles fakecuda, a CPU stand-in for the CUDA 13 stack with asynchronous
//! streams: the driver `libcuda.so.1` (versioned symbols and the `cuGetProcAddress` resolver) and
//! the runtime over it, shared (`libcudart.so.13`) and static (`libcudart_static.a`), which
//! reaches the driver only through `dlopen` + `cuGetProcAddress_v2` as the real one does. It
//! builds each C program of `programs/` twice, `NAME` over the shared runtime and `NAME_static`
//! over the static one, except the driver API programs `driver_*` (built once, over libcuda
//! alone). `libcachealloc.so` is the one cargo built for this workspace (`cargo build -p
//! cachealloc`, done by `scripts/test`).

pub mod fuzz;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cachealloc_recorder::{Record, Tear, TraceReader};

/// Where fakecuda's libraries are.
pub fn fakecuda_dir() -> PathBuf {
    PathBuf::from(env!("FAKECUDA_DIR"))
}

/// A compiled test program.
pub fn program(name: &str) -> PathBuf {
    PathBuf::from(env!("PROGRAMS_DIR")).join(name)
}

/// The `libcachealloc.so` cargo built next to this test binary (`target/<profile>/`).
pub fn shim_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let lib = profile_dir.join("libcachealloc.so");
    assert!(
        lib.exists(),
        "{} is missing: build it first with `cargo build -p cachealloc` (scripts/test does)",
        lib.display()
    );
    lib
}

/// Remove the directories `<temp>/<prefix><pid>-…` of test processes that have ended: a test
/// leaves its directories behind (to be looked at when it fails), and without this every run
/// would add its hundreds of megabytes to the temporary directory. A live process's (another
/// test binary's, running now) are left alone.
pub fn sweep_ended_runs(prefix: &str) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A fresh, empty directory for one run (its working directory, where the default trace goes).
/// The first call removes the directories of ended test processes ([`sweep_ended_runs`]): these
/// tests' and the tools crate's (`cachealloc-tools-<pid>-…`, its scratch directories).
pub fn fresh_dir() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(|| {
        sweep_ended_runs("cachealloc-e2e-");
        sweep_ended_runs("cachealloc-tools-");
    });
    let dir = std::env::temp_dir().join(format!(
        "cachealloc-e2e-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}

/// The per-process trace directories under `trace_root`.
pub fn trace_dirs(trace_root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(trace_root)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

/// How many of `records` are of `kind` (`schema::kinds`).
pub fn count(records: &[Record], kind: u8) -> usize {
    records.iter().filter(|r| r.kind() == kind).count()
}

/// Every record of a trace directory, and the tears found.
pub fn read_trace(dir: &Path) -> (Vec<Record>, Vec<Tear>) {
    let mut reader = TraceReader::open(dir).expect("open trace");
    let records = reader
        .by_ref()
        .map(|item| item.expect("read trace").record)
        .collect();
    (records, reader.tears().to_vec())
}

/// What a run produced.
#[derive(Debug)]
pub struct Output {
    /// Exit code (`None`: killed by a signal or the timeout).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// The run's working directory (its default trace is in `cachealloc-trace/` there).
    pub dir: PathBuf,
}

impl Output {
    /// The per-process trace directories the run wrote to its default trace root
    /// (`cachealloc-trace/` in its working directory).
    pub fn trace_dirs(&self) -> Vec<PathBuf> {
        trace_dirs(&self.dir.join("cachealloc-trace"))
    }

    /// The run's one trace directory (asserting there is exactly one).
    pub fn one_trace(&self) -> PathBuf {
        let dirs = self.trace_dirs();
        assert_eq!(
            dirs.len(),
            1,
            "one trace, in {}: {dirs:?}",
            self.dir.display()
        );
        dirs[0].clone()
    }

    /// The numbers on the first line of stdout that starts with `label` (the programs print
    /// their results as `label N …`).
    pub fn numbers_after(&self, label: &str) -> Vec<u64> {
        let line = self
            .stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no '{label}' line in:\n{}", self.stdout));
        line.split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect()
    }

    /// The one number on the first line of stdout that starts with `label`.
    pub fn number_after(&self, label: &str) -> u64 {
        match self.numbers_after(label)[..] {
            [n] => n,
            ref other => panic!("'{label}': one number expected, got {other:?}"),
        }
    }

    /// The number before `what` (one of its counts, e.g. `"device allocations"`,
    /// `"physical creates"`) in fakecuda's report (`FAKECUDA_REPORT=1`) of the last process to
    /// exit.
    pub fn fakecuda_count(&self, what: &str) -> u64 {
        let line = self
            .stderr
            .lines()
            .rfind(|l| l.starts_with("fakecuda:"))
            .unwrap_or_else(|| panic!("no fakecuda report: {}", self.stderr));
        let at = line
            .find(what)
            .unwrap_or_else(|| panic!("no '{what}' in {line}"));
        line[..at]
            .split_whitespace()
            .last()
            .and_then(|n| n.trim_end_matches(',').parse().ok())
            .unwrap_or_else(|| panic!("cannot read '{what}' in {line}"))
    }

    /// Assert the program's own check failed: it exited 1 and said `message` on stdout (the
    /// controls, which show that a test can fail).
    pub fn assert_fails_with(&self, message: &str) {
        assert!(
            self.code == Some(1) && self.stdout.contains(message),
            "expected exit 1 and '{message}' (exit {:?})\n--- stdout\n{}--- stderr\n{}",
            self.code,
            self.stdout,
            self.stderr
        );
    }

    /// Assert the program printed `OK <name>` and exited 0, and that the shim neither failed
    /// internally (it degrades to passthrough with one message, which a program's own check
    /// cannot see) nor panicked.
    pub fn assert_ok(&self, name: &str) {
        assert!(
            self.code == Some(0) && self.stdout.contains(&format!("OK {name}")),
            "{name} failed (exit {:?})\n--- stdout\n{}--- stderr\n{}",
            self.code,
            self.stdout,
            self.stderr
        );
        for sign in ["internal failure", "panicked"] {
            assert!(
                !self.stderr.contains(sign),
                "{name}: the shim reported '{sign}'\n--- stderr\n{}",
                self.stderr
            );
        }
    }

    /// [`Output::assert_ok`], and the pools served the program: its exit summary counts
    /// allocations that reached them ("N of M allocations served from the cache", M > 0; a
    /// shim that passed through, or was not loaded, prints no such line).
    pub fn assert_pooled(&self, name: &str) {
        self.assert_ok(name);
        let requests = self
            .stderr
            .lines()
            .filter_map(|l| {
                let (before, _) = l.split_once(" allocations served from the cache")?;
                before.rsplit_once(" of ")?.1.parse::<u64>().ok()
            })
            .sum::<u64>();
        assert!(
            requests > 0,
            "{name}: no allocation reached the pools\n--- stderr\n{}",
            self.stderr
        );
    }
}

/// A program run under the shim (or not) over fakecuda.
#[derive(Debug)]
pub struct Run {
    command: Command,
    timeout: Duration,
    dir: PathBuf,
    kill_after: Option<(String, Duration)>,
}

impl Run {
    /// Run `program` (a path, or a name looked up on PATH) with `args` under the shim.
    pub fn new(program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Run {
        let dir = fresh_dir();
        let mut command = Command::new(program);
        command
            .current_dir(&dir)
            .args(args)
            .env("LD_PRELOAD", shim_library())
            .env("LD_LIBRARY_PATH", fakecuda_dir())
            .env_remove("CACHEALLOC_CONF")
            .env_remove("PYTORCH_CUDA_ALLOC_CONF")
            .env_remove("PYTORCH_NO_CUDA_MEMORY_CACHING")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Run {
            command,
            timeout: Duration::from_secs(60),
            dir,
            kill_after: None,
        }
    }

    /// One of the compiled C programs.
    pub fn c(name: &str, args: &[&str]) -> Run {
        Run::new(program(name), args)
    }

    /// A Python program of `tests/programs/` that needs no shim (it tests the integration's
    /// build machinery or a benchmark script), run by `$PYTHON` (default `python3`).
    pub fn python_script(name: &str) -> Run {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("programs")
            .join(name);
        Run::new(python, &[script.to_str().expect("a UTF-8 path")]).without_shim()
    }

    /// Set an environment variable.
    pub fn env(mut self, key: &str, value: &str) -> Run {
        self.command.env(key, value);
        self
    }

    /// Kill the program if it runs longer than `timeout` (default 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Run {
        self.timeout = timeout;
        self
    }

    /// Kill the program with SIGKILL `after` it printed `line` on stdout.
    pub fn kill_after(mut self, line: &str, after: Duration) -> Run {
        self.kill_after = Some((line.to_string(), after));
        self
    }

    /// Run without the shim (the same program straight over fakecuda).
    pub fn without_shim(mut self) -> Run {
        self.command.env_remove("LD_PRELOAD");
        self
    }

    /// Run to completion (killed after the timeout, which a deadlock would hit).
    pub fn output(mut self) -> Output {
        let mut child = self.command.spawn().expect("spawn test program");
        let mut stdout = child.stdout.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let (seen_tx, seen_rx) = std::sync::mpsc::channel();
        let wanted = self.kill_after.as_ref().map(|(line, _)| line.clone());
        let out_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                s.push_str(&String::from_utf8_lossy(&buf[..n]));
                if wanted.as_ref().is_some_and(|w| s.contains(w.as_str())) {
                    let _ = seen_tx.send(());
                }
            }
            s
        });
        if let Some((_, after)) = &self.kill_after
            && seen_rx.recv_timeout(self.timeout).is_ok()
        {
            std::thread::sleep(*after);
            let _ = child.kill(); // SIGKILL
        }
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break Some(status);
            }
            if start.elapsed() > self.timeout {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        Output {
            code: status.and_then(|s| s.code()),
            stdout: out_reader.join().unwrap(),
            stderr: err_reader.join().unwrap(),
            dir: self.dir,
        }
    }
}

/// Run `program` under the shim with `conf` (and `env`), assert it passed, and return its trace
/// directory.
pub fn traced(program: &str, args: &[&str], conf: &str, env: &[(&str, &str)]) -> PathBuf {
    let mut run = Run::c(program, args).env("CACHEALLOC_CONF", conf);
    for (k, v) in env {
        run = run.env(k, v);
    }
    let out = run.output();
    out.assert_ok(program);
    let dirs = out.trace_dirs();
    assert_eq!(
        dirs.len(),
        1,
        "{program} {args:?} {conf:?}: one trace, in {}",
        out.dir.display()
    );
    dirs[0].clone()
}

/// The `cachealloc` binary cargo built next to the shim (`cargo test --workspace` builds it).
pub fn cachealloc_binary() -> PathBuf {
    let bin = shim_library().with_file_name("cachealloc");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p cachealloc-tools`",
        bin.display()
    );
    bin
}

/// A CPython interpreter found on this machine.
#[derive(Debug, Clone)]
pub struct Python {
    /// The executable.
    pub path: PathBuf,
    /// Major and minor version.
    pub version: (u32, u32),
    /// Its C headers (`sysconfig`'s `include`).
    pub include: PathBuf,
}

/// Every CPython 3 on this machine, one per minor version: `$PYTHON` or `python3` on PATH
/// first, then pyenv's installs (`$PYENV_ROOT`, default `~/.pyenv`).
pub fn pythons() -> Vec<Python> {
    let mut candidates = vec![PathBuf::from(
        std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()),
    )];
    let pyenv = std::env::var("PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".pyenv")
        });
    if let Ok(entries) = std::fs::read_dir(pyenv.join("versions")) {
        let mut installs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin/python3"))
            .filter(|p| p.exists())
            .collect();
        installs.sort();
        candidates.extend(installs);
    }
    let mut found: Vec<Python> = vec![];
    for path in candidates {
        let Ok(out) = Command::new(&path)
            .args([
                "-c",
                "import sys, sysconfig; print(*sys.version_info[:2], sysconfig.get_paths()['include'])",
            ])
            .output()
        else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let mut words = text.split_whitespace();
        let (Some(major), Some(minor), Some(include)) = (words.next(), words.next(), words.next())
        else {
            continue;
        };
        let (Ok(major), Ok(minor)) = (major.parse(), minor.parse()) else {
            continue;
        };
        if major == 3 && !found.iter().any(|p| p.version == (major, minor)) {
            found.push(Python {
                path,
                version: (major, minor),
                include: PathBuf::from(include),
            });
        }
    }
    found
}

/// Each allocation's stack by its requested size (the test programs give every allocation its
/// own size): the frame definitions, innermost first; empty for an allocation without a stack.
pub fn alloc_stacks(
    records: &[Record],
) -> std::collections::HashMap<u64, Vec<cachealloc_recorder::schema::FrameDef>> {
    use std::collections::HashMap;
    let mut frames = HashMap::new();
    let mut stacks: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut by_size = HashMap::new();
    for r in records {
        match r {
            Record::FrameDef(f) => {
                frames.insert(f.id, (**f).clone());
            }
            Record::StackDef(s) => {
                stacks.insert(s.id, s.frames.clone());
            }
            Record::Alloc(a) => {
                let stack = stacks
                    .get(&a.stack)
                    .map(|ids| ids.iter().map(|id| frames[id].clone()).collect())
                    .unwrap_or_default();
                by_size.insert(a.requested, stack);
            }
            _ => {}
        }
    }
    by_size
}
