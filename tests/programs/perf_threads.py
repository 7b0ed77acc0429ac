"""scripts/gpu/perf_threads.py without a GPU: a hand-written `perf script` listing (two threads,
five samples) aggregated, then reported. Checks the counters (each sample's innermost library
and symbol, the libraries anywhere on its stack counted once, the innermost Python function)
and that the report turns samples into ms a step. Prints `OK perf_threads` on success."""
import importlib.util
import io
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "perf_threads", os.path.join(ROOT, "scripts", "gpu", "perf_threads.py"))
perf_threads = importlib.util.module_from_spec(spec)
spec.loader.exec_module(perf_threads)

LISTING = """\
python3 100 
\t    7f01 capture_skipping (/opt/x/libcachealloc.so)
\t    7f02 cudaMallocAsync (/opt/x/libcachealloc.so)
\t    7f03 py::_call_impl:/tmp/cachealloc-python-0/cachealloc_categories.py (/tmp/perf-100.map)
\t    7f04 py::forward:/site/transformers/modeling_llama.py (/tmp/perf-100.map)

python3 100 
\t    7f05 _PyEval_EvalFrameDefault (/usr/bin/python3.12)
\t    7f06 py::forward:/site/transformers/modeling_llama.py (/tmp/perf-100.map)

python3 100 
\t    7f07 ioctl ([kernel.kallsyms])
\t    7f08 cuMemSetAccess (/usr/lib/libcuda.so.580)
\t    7f09 map (/opt/x/libcachealloc.so)

pt_autograd_0 101 
\t    7f0a malloc (/usr/lib/libc.so.6)
\t    7f0b c10_alloc (/opt/torch/lib/libc10_cuda.so)
\t    7f0c cudaMallocAsync (/opt/x/libcachealloc.so)
\t    7f0d other (/opt/torch/lib/libc10_cuda.so)
pt_autograd_0 101 
\t    7f0e gemm (/opt/torch/lib/libtorch_cuda.so)
"""

p = perf_threads.aggregate(io.StringIO(LISTING), "default", 2)
assert p["label"] == "default" and p["steps"] == 2, p
main, autograd = p["threads"]["python3"], p["threads"]["pt_autograd_0"]
assert main["n"] == {"samples": 3}, main["n"]
assert autograd["n"] == {"samples": 2}, autograd["n"]
assert main["leaf_dso"] == {"libcachealloc.so": 1, "python3.12": 1, "[kernel.kallsyms]": 1}, main
assert main["leaf_sym"]["capture_skipping [libcachealloc.so]"] == 1, main["leaf_sym"]
# Anywhere on the stack, once per sample: two of the main thread's samples are under the shim.
assert main["incl"]["libcachealloc.so"] == 2, main["incl"]
assert main["incl"]["libcuda.so"] == 1 and main["incl"]["kernel.kallsyms"] == 1, main["incl"]
assert autograd["incl"]["libc10_cuda"] == 1 and autograd["incl"]["libcachealloc.so"] == 1, autograd
# The innermost Python function: the integration's wrapper in the first sample only.
assert main["py_inner"] == {
    "py::_call_impl:/tmp/cachealloc-python-0/cachealloc_categories.py": 1,
    "py::forward:/site/transformers/modeling_llama.py": 1,
}, main["py_inner"]
assert main["incl"]["py_cachealloc_inner"] == 1, main["incl"]

# The report: 3 samples over 2 steps at 1 kHz is 1.5 ms a step; against a native profile.
native = perf_threads.aggregate(io.StringIO(LISTING.split("python3 100 \n\t    7f07")[0]), "native", 1)
out = io.StringIO()
perf_threads.report(1.0, [native, p], out)
text = out.getvalue()
assert "== python3: ms a step 2.00 1.50" in text, text
# Rows by (thread, table, key).
rows, comm, table = {}, None, None
for line in text.splitlines():
    if line.startswith("== "):
        comm = line.split()[1].rstrip(":")
    elif line.startswith("  ") and line.split()[1:] == ["native", "default"]:
        table = line.split()[0]
    else:
        rows[(comm, table, line.split()[0])] = line.split()[1:]
# Under the shim: 1 of native's 2 samples in 1 step, 2 of 3 in 2 steps.
assert rows[("python3", "incl", "libcachealloc.so")] == ["1.000", "1.000"], rows
assert rows[("python3", "leaf_dso", "[kernel.kallsyms]")] == ["0.000", "0.500"], rows
assert rows[("pt_autograd_0", "incl", "libc10_cuda")] == ["0.000", "0.500"], rows
print("OK perf_threads")
