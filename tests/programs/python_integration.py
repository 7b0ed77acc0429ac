"""The shim's Python integration, run under LD_PRELOAD=libcachealloc.so (no torch needed): the
sitecustomize the integration shadows still runs, and importing torch._inductor.config (a
stand-in package made here) turns CUDA graph trees off on the cudaMallocAsync route.
Usage: python_integration.py EXPECTED_TREES   (True or False). Prints "OK python_integration"."""
import os
import sys
import tempfile


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


if os.environ.get("USER_SITECUSTOMIZE_RAN") != "1":
    fail("the user's own sitecustomize did not run")
if "torch" in sys.modules:
    fail("the integration imported torch")

root = tempfile.mkdtemp()
package = os.path.join(root, "torch", "_inductor")
os.makedirs(package)
for d in (os.path.join(root, "torch"), package):
    open(os.path.join(d, "__init__.py"), "w").close()
with open(os.path.join(package, "config.py"), "w") as f:
    f.write("class triton:\n    cudagraph_trees = True\n    cudagraphs = False\n")
sys.path.insert(0, root)

import torch._inductor.config as config  # noqa: E402

expected = sys.argv[1] == "True"
if config.triton.cudagraph_trees is not expected:
    fail(f"cudagraph_trees is {config.triton.cudagraph_trees}, expected {expected}")
print("OK python_integration")
