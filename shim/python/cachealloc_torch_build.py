"""Building cachealloc's C++ pieces for PyTorch against the PyTorch in use: the allocator for
PyTorch (`cachealloc_torch_allocator.py`, built while the program waits: `build`) and the
backward scopes (`cachealloc_backward_scopes.py`, built by a process of its own while the
program runs: `build_detached`). PyTorch's C++ interfaces change between releases, so each
piece is compiled on the machine, once per PyTorch build, compiler, flags and sources, into
`$XDG_CACHE_HOME/cachealloc/torch-allocator/<hash>/` (else `~/.cache/…`). Processes that start
together wait for one build (a file lock); a failed build is not tried again (its compiler
output stays in `build.log` of that directory: remove it to try again).
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

from cachealloc_common import warn

HERE = os.path.dirname(os.path.abspath(__file__))


def compiler():
    """`$CXX`, else `c++` or `g++` on the PATH, or None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cachealloc", "torch-allocator")


def torch_flags(torch_dir, abi):
    """The compiler flags every piece shares: C++17, position-independent, PyTorch's ABI and
    headers, and the headers beside this file."""
    return [
        "-std=c++17", "-O2", "-fPIC", "-shared", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(bool(abi))}",
        "-I", HERE, "-I", os.path.join(torch_dir, "include"),
    ]


def torch_libraries(torch_dir, names):
    """Link flags for PyTorch's libraries `names` (e.g. `c10`), found at run time where they
    are. The C++ runtime is the process's own (libstdc++.so.6, which PyTorch uses): where only
    the static library is installed for `-lstdc++`, a second copy inside a piece crashes on its
    first formatted message."""
    lib = os.path.join(torch_dir, "lib")
    return ["-L", lib, *(f"-l{n}" for n in names), "-l:libstdc++.so.6", f"-Wl,-rpath,{lib}"]


def _place(torch_dir, source, headers, flags, libraries, target_name):
    """(directory, library path) of a build: the directory is named by a hash of everything
    that makes the build (sources, PyTorch's version file, compiler, flags)."""
    text = b""
    for name in (source, *headers):
        with open(os.path.join(HERE, name), "rb") as f:
            text += f.read() + b"\0"
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++)")
    key = hashlib.sha256()
    with open(os.path.join(torch_dir, "version.py"), "rb") as f:
        torch_version = f.read()
    for part in (text, torch_version, cxx.encode(), " ".join(flags + libraries).encode()):
        key.update(part)
        key.update(b"\0")
    directory = os.path.join(cache_dir(), key.hexdigest()[:16])
    return directory, os.path.join(directory, target_name)


def built(torch_dir, source, headers, flags, libraries, target_name, what):
    """Whether `build` with these arguments would find its library built; raises RuntimeError
    without a compiler."""
    return os.path.isfile(_place(torch_dir, source, headers, flags, libraries, target_name)[1])


def _failed_before(log):
    return RuntimeError(
        f"its build failed before (compiler output in {log}; remove it to try again)"
    )


def build_detached(torch_dir, source, headers, flags, libraries, target_name, what):
    """`build` in a process of its own, which outlives this one (a short program that ends
    before the compiler would otherwise start it again at every run), unless the library is
    built or another process is building it. Returns `(library path, log path)` to look for;
    raises RuntimeError without a compiler or after a failed build."""
    directory, target = _place(torch_dir, source, headers, flags, libraries, target_name)
    log = os.path.join(directory, "build.log")
    if os.path.isfile(target):
        return target, log
    if os.path.isfile(log):
        raise _failed_before(log)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    import fcntl

    with open(os.path.join(directory, "lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return target, log  # being built
    # Without the preloaded library (a compiler needs no trace) and without site (the
    # integration's sitecustomize): `build` alone, with its lock.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import cachealloc_torch_build as b; "
        "b.build(*json.loads(sys.argv[2]))"
    )
    arguments = json.dumps([torch_dir, source, list(headers), flags, libraries, target_name, what])
    subprocess.Popen(
        [sys.executable, "-S", "-c", code, HERE, arguments], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    warn(f"building {what} in the background (once per PyTorch build) into {directory}")
    return target, log


def build(torch_dir, source, headers, flags, libraries, target_name, what):
    """The path of the library `target_name` built from `source` (with `headers`, all beside
    this file) by `flags` and `libraries`, building it if needed (`what` names it in the one
    message a build prints); raises RuntimeError with the reason."""
    directory, target = _place(torch_dir, source, headers, flags, libraries, target_name)
    cxx = compiler()
    log = os.path.join(directory, "build.log")
    if os.path.isfile(target):
        return target
    if os.path.isfile(log):
        raise _failed_before(log)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    import fcntl

    with open(os.path.join(directory, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(target):
            return target
        warn(f"building {what} (once per PyTorch build) into {directory}")
        # What a process that ended during its build left (the lock is ours: none is running).
        for name in os.listdir(directory):
            if name.startswith(os.path.basename(target) + "."):
                os.unlink(os.path.join(directory, name))
        partial = f"{target}.{os.getpid()}"
        command = [cxx, *flags, os.path.join(HERE, source), "-o", partial, *libraries]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            with open(log, "w") as f:
                f.write(" ".join(command) + "\n" + done.stdout + done.stderr)
            raise RuntimeError(f"the build failed (compiler output in {log})")
        os.replace(partial, target)
    return target
