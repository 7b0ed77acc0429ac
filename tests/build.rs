//! Builds fakecuda (`libcuda.so.1`, `libcudart.so.13`) and the C (and C++) test programs into
//! OUT_DIR with the system compilers, and tells the tests where they are.
//!
//! The runtime has no link-time dependency on the driver: like the real one it reaches it only
//! through `dlopen("libcuda.so.1")` + `cuGetProcAddress_v2`. Both libraries are linked with
//! `-Bsymbolic`, so no internal call goes through an exported name.

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

    let mut cmd = compiler();
    cmd.args([
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-Wl,-Bsymbolic",
        "-Wl,-soname,libcuda.so.1",
    ])
    .arg("-I")
    .arg(&include)
    .arg("-o")
    .arg(fake.join("libcuda.so.1"))
    .arg(src.join("fakecuda.c"))
    .arg("-lpthread");
    run(cmd);
    // cudarc looks for libcuda.so first.
    let link = fake.join("libcuda.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("libcuda.so.1", &link).unwrap();

    // The runtime (-z defs proves it calls no cu* name directly).
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
        let kind = if name.starts_with("lib") {
            Output::Library
        } else {
            Output::Program
        };
        build_c((&path, &programs), &name, &include, &fake, &bin, kind);
    }
    println!("cargo:rerun-if-changed=fakecuda");
    println!("cargo:rerun-if-changed=programs");
    println!("cargo:rustc-env=FAKECUDA_DIR={}", fake.display());
    println!("cargo:rustc-env=PROGRAMS_DIR={}", bin.display());
}

/// The compiler command for one C file of `programs/` over fakecuda's runtime, writing `output`.
fn c_command(path: &Path, programs: &Path, include: &Path, fake: &Path, output: &Path) -> Command {
    let mut cmd = compiler();
    cmd.arg("-I")
        .arg(include)
        .arg("-I")
        .arg(programs)
        .arg("-o")
        .arg(output)
        .arg(path)
        .arg("-L")
        .arg(fake)
        .arg("-l:libcudart.so.13")
        .arg(format!("-Wl,-rpath-link,{}", fake.display()))
        .arg("-lpthread");
    cmd
}

/// What a C file of `programs/` becomes.
#[derive(Clone, Copy, PartialEq)]
enum Output {
    /// A test program, with fakecuda's `slow_fill`.
    Program,
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
        Output::Program => bin.join(name),
        Output::Library => bin.join(format!("{name}.so")),
    };
    let mut cmd = c_command(path, programs, include, fake, &output);
    match kind {
        Output::Program => cmd.arg(programs.join("slow_fill_fake.c")),
        Output::Library => cmd.args(["-shared", "-fPIC"]),
    };
    run(cmd);
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
