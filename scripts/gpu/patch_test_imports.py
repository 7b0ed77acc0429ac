"""Make a PyTorch test file newer than the installed PyTorch import on it (in place): the names
its top-level `from torch… import …` statements list that this PyTorch lacks are taken out and
defined after the imports — `TEST_CUDAMALLOCASYNC` as PyTorch defines it (the allocator backend
is `cudaMallocAsync`), any other as False — so both sides of `pytorch_allocator_tests.sh` run the
same file. Prints the names it defined.

    python3 scripts/gpu/patch_test_imports.py .pt/test_cuda.py
"""
import ast
import importlib
import re
import sys


def main(path):
    source = open(path).read()
    tree = ast.parse(source)
    lines = source.split("\n")
    missing = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            try:
                module = importlib.import_module(node.module)
            except Exception:
                continue
            missing += [(node, a.name) for a in node.names if not hasattr(module, a.name)]
    for node, name in missing:
        for i in range(node.lineno - 1, node.end_lineno):
            lines[i] = re.sub(rf"\b{name}\b\s*,?", "", lines[i])
    if missing:
        last = max(n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
        defined = [
            f"{name} = torch.cuda.is_available() and torch.cuda.get_allocator_backend() == 'cudaMallocAsync'"
            if name == "TEST_CUDAMALLOCASYNC" else f"{name} = False"
            for _, name in missing
        ]
        lines.insert(last, "\n".join(defined))
    patched = "\n".join(lines)
    ast.parse(patched)
    open(path, "w").write(patched)
    print("defined:", [name for _, name in missing])


if __name__ == "__main__":
    main(sys.argv[1])
