//! Builds fakecuda and the C (and C++) test programs into OUT_DIR with the system compilers, and
//! tells the tests where they are.
//!
//! fakecuda has the structure of the real CUDA 13 stack:
//! - `libcuda.so.1` (`fakecuda/fakecuda.c`): the driver API with its versioned and per-thread
//!   symbols and the `cuGetProcAddress` resolver (and a `libcuda.so` link to it);
//! - the runtime (`fakecuda/cudart.c`), which reaches the driver only through
//!   `dlopen("libcuda.so.1")` + `cuGetProcAddress_v2`, in two flavours: the shared
//!   `libcudart.so.13` and the static `libcudart_static.a` (hidden symbols, like nvcc's default
//!   static cudart). Both libraries are linked with `-Bsymbolic`, so no internal call goes
//!   through an exported name.
//!
//! Each C program `programs/NAME.c` (not `lib*.c`, not `slow_fill*`) becomes `NAME`, over the
//! shared runtime, and `NAME_static`, over the static one (checked with `readelf`/`nm`, where
//! present: no `libcudart` needed, no `cuda*` exported). Programs named `driver_*` use the driver
//! API only: they are built once, linked against `libcuda.so.1` as needed (one that only
//! dlopens it does not need it). `lib*.c` become helper libraries `lib*.so` for the Python
//! programs; the C++ program is built over the shared runtime.

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(mut cmd: Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?} failed");
}

fn compiler() -> Command {
    let tool = cc::Build::new().get_compiler();
    let mut cmd = tool.to_command();
    cmd.args(["-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter"]);
    cmd
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let fake = out.join("fakecuda");
    let bin = out.join("programs");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    let src = root.join("fakecuda");
    let include = src.join("include");

    // The driver; and in `without_primary_ctx_state/`, one lacking a function the shim needs.
    let missing = fake.join("without_primary_ctx_state");
    std::fs::create_dir_all(&missing).unwrap();
    for (dir, defines) in [
        (&fake, &[][..]),
        (&missing, &["-DFAKECUDA_WITHOUT_PRIMARY_CTX_STATE"][..]),
    ] {
        let mut cmd = compiler();
        cmd.args([
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libcuda.so.1",
        ])
        .args(defines)
        .arg("-I")
        .arg(&include)
        .arg("-o")
        .arg(dir.join("libcuda.so.1"))
        .arg(src.join("fakecuda.c"))
        .arg("-lpthread");
        run(cmd);
        // cudarc looks for libcuda.so first.
        let link = dir.join("libcuda.so");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libcuda.so.1", &link).unwrap();
    }

    // The shared runtime: no link-time dependency on the driver (-z defs proves it calls no
    // cu* name directly).
    let mut cmd = compiler();
    cmd.args([
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-Wl,-Bsymbolic",
        "-Wl,-z,defs",
        "-Wl,-soname,libcudart.so.13",
    ])
    .arg("-I")
    .arg(&include)
    .arg("-o")
    .arg(fake.join("libcudart.so.13"))
    .arg(src.join("cudart.c"))
    .args(["-ldl", "-lpthread"]);
    run(cmd);

    // The static runtime.
    let object = fake.join("cudart_static.o");
    let mut cmd = compiler();
    cmd.args(["-c", "-fPIC", "-fvisibility=hidden", "-DCUDART_STATIC"])
        .arg("-I")
        .arg(&include)
        .arg("-o")
        .arg(&object)
        .arg(src.join("cudart.c"));
    run(cmd);
    let archive = fake.join("libcudart_static.a");
    let _ = std::fs::remove_file(&archive);
    let mut cmd = cc::Build::new().get_archiver();
    cmd.arg("crs").arg(&archive).arg(&object);
    run(cmd);

    let programs = root.join("programs");
    for entry in std::fs::read_dir(&programs).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        if path.extension().is_some_and(|e| e == "cc") {
            build_cpp_program(&path, &name, &include, &fake, &bin);
            continue;
        }
        if path.extension().is_none_or(|e| e != "c") || name.starts_with("slow_fill") {
            continue;
        }
        let paths = (path.as_path(), programs.as_path());
        if name.starts_with("lib") {
            build_c(paths, &name, &include, &fake, &bin, Output::Library);
        } else if name.starts_with("driver_") {
            build_c(paths, &name, &include, &fake, &bin, Output::DriverProgram);
        } else {
            build_c(paths, &name, &include, &fake, &bin, Output::Program);
            build_c(paths, &name, &include, &fake, &bin, Output::StaticProgram);
            check_static(&bin.join(format!("{name}_static")));
        }
    }
    println!("cargo:rerun-if-changed=fakecuda");
    println!("cargo:rerun-if-changed=programs");
    println!("cargo:rustc-env=FAKECUDA_DIR={}", fake.display());
    println!("cargo:rustc-env=PROGRAMS_DIR={}", bin.display());
}

/// What a C file of `programs/` becomes.
#[derive(Clone, Copy, PartialEq)]
enum Output {
    /// A test program over the shared runtime, with fakecuda's `slow_fill` (`NAME`).
    Program,
    /// The same over the static runtime (`NAME_static`).
    StaticProgram,
    /// A driver API program (`driver_*`): libcuda only, as needed.
    DriverProgram,
    /// A helper library for the Python programs (`lib*.c` → `lib*.so`).
    Library,
}

fn build_c(
    paths: (&Path, &Path),
    name: &str,
    include: &Path,
    fake: &Path,
    bin: &Path,
    kind: Output,
) {
    let (path, programs) = paths;
    let output = match kind {
        Output::Program | Output::DriverProgram => bin.join(name),
        Output::StaticProgram => bin.join(format!("{name}_static")),
        Output::Library => bin.join(format!("{name}.so")),
    };
    let mut cmd = compiler();
    cmd.arg("-I")
        .arg(include)
        .arg("-I")
        .arg(programs)
        .arg("-o")
        .arg(output)
        .arg(path);
    if kind == Output::Program || kind == Output::StaticProgram {
        cmd.arg(programs.join("slow_fill_fake.c"));
    }
    if kind == Output::Library {
        cmd.args(["-shared", "-fPIC"]);
    }
    cmd.arg("-L").arg(fake);
    match kind {
        Output::Program | Output::Library => {
            cmd.arg("-l:libcudart.so.13");
        }
        Output::StaticProgram => {
            cmd.args(["-l:libcudart_static.a", "-ldl"]);
        }
        Output::DriverProgram => {
            cmd.args([
                "-Wl,--as-needed",
                "-l:libcuda.so.1",
                "-Wl,--no-as-needed",
                "-ldl",
            ]);
        }
    }
    cmd.arg(format!("-Wl,-rpath-link,{}", fake.display()))
        .arg("-lpthread");
    run(cmd);
}

/// A program over the static runtime must neither need `libcudart` nor export the runtime's
/// names (they stay local to it). Checked with binutils where the machine has them.
fn check_static(program: &Path) {
    let output = |tool: &str, args: &[&str]| {
        Command::new(tool)
            .args(args)
            .arg(program)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let Some(dynamic) = output("readelf", &["-d", "-W"]) else {
        println!(
            "cargo:warning=readelf not found: {} not checked",
            program.display()
        );
        return;
    };
    assert!(
        !dynamic.contains("libcudart"),
        "{} needs libcudart:\n{dynamic}",
        program.display()
    );
    if let Some(symbols) = output("nm", &["-D", "--defined-only"]) {
        let exported: Vec<&str> = symbols
            .lines()
            .filter_map(|l| l.split_whitespace().last())
            .filter(|s| s.starts_with("cuda"))
            .collect();
        assert!(
            exported.is_empty(),
            "{} exports {exported:?}",
            program.display()
        );
    }
}

/// A C++ test program (no shared helpers: they are C).
fn build_cpp_program(path: &Path, name: &str, include: &Path, fake: &Path, bin: &Path) {
    let tool = cc::Build::new().cpp(true).get_compiler();
    let mut cmd = tool.to_command();
    cmd.arg("-O1")
        .arg("-fno-inline")
        .arg("-I")
        .arg(include)
        .arg("-o")
        .arg(bin.join(name))
        .arg(path)
        .arg("-L")
        .arg(fake)
        .arg("-l:libcudart.so.13")
        .arg(format!("-Wl,-rpath-link,{}", fake.display()));
    run(cmd);
}
