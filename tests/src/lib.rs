//! Helpers for cachealloc's end-to-end tests: run a program under
//! `LD_PRELOAD=libcachealloc.so` over fakecuda and capture what it did.
//!
//! The build script compiles fakecuda (a CPU stand-in for `libcudart.so.13` and `libcuda.so.1`
//! with asynchronous streams) and the C programs of `programs/`; `libcachealloc.so` is the one
//! cargo built for this workspace (`cargo build -p cachealloc`, done by `scripts/test`).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

/// What a run produced.
#[derive(Debug)]
pub struct Output {
    /// Exit code (`None`: killed by a signal or the timeout).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Output {
    /// Assert the program printed `OK <name>` and exited 0.
    pub fn assert_ok(&self, name: &str) {
        assert!(
            self.code == Some(0) && self.stdout.contains(&format!("OK {name}")),
            "{name} failed (exit {:?})\n--- stdout\n{}--- stderr\n{}",
            self.code,
            self.stdout,
            self.stderr
        );
    }
}

/// A program run under the shim (or not) over fakecuda.
#[derive(Debug)]
pub struct Run {
    command: Command,
    timeout: Duration,
}

impl Run {
    /// Run `program` (a path, or a name looked up on PATH) with `args` under the shim.
    pub fn new(program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Run {
        let mut command = Command::new(program);
        command
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
        }
    }

    /// One of the compiled C programs.
    pub fn c(name: &str, args: &[&str]) -> Run {
        Run::new(program(name), args)
    }

    /// Set an environment variable.
    pub fn env(mut self, key: &str, value: &str) -> Run {
        self.command.env(key, value);
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
        let out_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            s
        });
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
        }
    }
}
