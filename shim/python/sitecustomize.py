"""Started by Python at start-up because cachealloc put this directory first on PYTHONPATH: run
the `sitecustomize` this one shadows (if any), then install cachealloc's import hooks."""
import importlib.util
import os
import sys


def _run_shadowed():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        directory = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(directory, "sitecustomize.py")
        if directory == here or not os.path.isfile(candidate):
            continue
        spec = importlib.util.spec_from_file_location("_cachealloc_shadowed_sitecustomize", candidate)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return


try:
    _run_shadowed()
finally:
    try:
        import cachealloc_hooks

        cachealloc_hooks.install()
    except Exception as e:  # the user's program must start whatever happens here
        print(f"cachealloc: Python integration off: {e}", file=sys.stderr)
