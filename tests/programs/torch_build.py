"""The builder of cachealloc's C++ pieces for PyTorch (shim/python/cachealloc_torch_build.py),
without PyTorch: a stand-in PyTorch directory (its `version.py`) and small C++ sources.
  * A detached build finishes after the process that started it has ended (a short program
    must not restart the build at every run), and its library loads.
  * `built` says so; `build` then returns the same library without building.
  * A source that does not compile leaves `build.log`, and later calls refuse to try again,
    naming it.
Prints `OK torch_build` at the end; exits non-zero (an assertion) otherwise."""
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(HERE, "..", "..", "shim", "python")
sys.path.insert(0, PYTHON_DIR)
import cachealloc_torch_build as build  # noqa: E402

work = tempfile.mkdtemp()
os.environ["XDG_CACHE_HOME"] = os.path.join(work, "cache")
torch_dir = os.path.join(work, "torch")
os.makedirs(torch_dir)
with open(os.path.join(torch_dir, "version.py"), "w") as f:
    f.write("__version__ = '0.0'\n")
good = os.path.join(work, "good.cpp")
with open(good, "w") as f:
    f.write('extern "C" int cachealloc_test_answer() { return 42; }\n')
bad = os.path.join(work, "bad.cpp")
with open(bad, "w") as f:
    f.write("this is not C++\n")
flags = ["-std=c++17", "-O0", "-fPIC", "-shared"]
good_how = (torch_dir, good, (), flags, [], "libgood.so", "a test piece")
bad_how = (torch_dir, bad, (), flags, [], "libbad.so", "a broken test piece")


def wait_for(path, what):
    for _ in range(1200):
        if os.path.isfile(path):
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} never appeared: {path}")


assert not build.built(*good_how)
# Started by a process that ends at once: the build still finishes.
starter = (
    "import sys; sys.path.insert(0, sys.argv[1]); import cachealloc_torch_build as b; "
    "t, l = b.build_detached(sys.argv[2], sys.argv[3], (), sys.argv[4].split(), [], "
    "'libgood.so', 'a test piece'); print(t); print(l)"
)
started = subprocess.run(
    [sys.executable, "-c", starter, PYTHON_DIR, torch_dir, good, " ".join(flags)],
    capture_output=True, text=True, check=True,
)
target, log = started.stdout.split()
assert "in the background" in started.stderr, started.stderr
wait_for(target, "the detached build's library")
assert ctypes.CDLL(target).cachealloc_test_answer() == 42
assert build.built(*good_how)
assert build.build(*good_how) == target
# Built: asking again starts nothing and says nothing.
again = subprocess.run(
    [sys.executable, "-c", starter, PYTHON_DIR, torch_dir, good, " ".join(flags)],
    capture_output=True, text=True, check=True,
)
assert again.stderr == "", again.stderr
assert not os.path.isfile(log), "no log for a build that worked"

# A failed build is remembered, with the compiler's words.
target, log = build.build_detached(*bad_how)
wait_for(log, "the failed build's log")
time.sleep(0.2)
assert not os.path.isfile(target)
with open(log) as f:
    assert "bad.cpp" in f.read()
for attempt in (build.build_detached, build.build):
    try:
        attempt(*bad_how)
    except RuntimeError as e:
        assert "build.log" in str(e), e
    else:
        raise AssertionError(f"{attempt.__name__} tried a failed build again")
shutil.rmtree(work, ignore_errors=True)
print("OK torch_build")
