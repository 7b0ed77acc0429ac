"""Python stacks under cachealloc: allocates through ctypes from known functions at known lines,
with the GIL released by the call (ctypes.CDLL), held through it (ctypes.PyDLL), from a second
thread, from a generator, from functions whose code objects are freed and made again at the
same address, and from the same two lines again and again, and writes what each allocation's
stack must be to the JSON file named by argv[1]:
[{"size": N, "gil": bool, "frames": [[qualname, file, line], ...]}], innermost first, as Python
itself reports them. Prints "OK python_stacks"."""
import ctypes
import json
import sys
import threading

ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
released = ctypes.CDLL(None)  # the call releases the GIL
held = ctypes.PyDLL(None)  # the call keeps the GIL
for lib in (released, held):
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaFree.argtypes = [ctypes.c_void_p]

expected = []
next_size = [1 << 20]


def name_of(code):
    return getattr(code, "co_qualname", code.co_name)


def stack_from(frame, innermost_line):
    """Python's own view of the stack, innermost first, with the innermost frame at the line
    that will make the call."""
    frames = []
    line = innermost_line
    while frame is not None:
        frames.append([name_of(frame.f_code), frame.f_code.co_filename, line])
        frame = frame.f_back
        line = frame.f_lineno if frame is not None else 0
    return frames


def allocate(lib):
    size = next_size[0]
    next_size[0] += 4096
    p = ctypes.c_void_p()
    here = sys._getframe()
    expected.append({"size": size, "gil": lib is held, "frames": stack_from(here, here.f_lineno + 1)})
    if lib.cudaMalloc(ctypes.byref(p), size) != 0:
        raise SystemExit(f"FAIL: cudaMalloc({size})")
    return p.value


class Model:
    def forward(self, lib, depth):
        if depth == 0:
            return allocate(lib)
        return self.forward(lib, depth - 1)


def generator(lib):
    yield allocate(lib)


def generated_functions(lib, ptrs, count=24):
    """Functions compiled one after another, each freed before the next is made: CPython often
    makes the next code object at the freed one's address, so the stack read off the frames is
    the same but for the code object behind that address. Each allocation's stack must name its
    own function, not the freed one's. Returns how many code objects took a freed one's
    address."""
    import gc

    addresses, reused = set(), 0
    for i in range(count):
        namespace = {"allocate": allocate, "lib": lib}
        exec(compile(f"def made_{i}():\n    return allocate(lib)\n", "<generated>", "exec"), namespace)
        function = namespace[f"made_{i}"]
        reused += id(function.__code__) in addresses
        addresses.add(id(function.__code__))
        ptrs.append(function())
        del function, namespace
        gc.collect()
    return reused


def two_lines(lib, ptrs, rounds=4):
    """The same two stacks again and again, differing only in this frame's line: the repeats
    are found in the thread's recent stacks, and each must keep its own line."""
    for _ in range(rounds):
        ptrs.append(allocate(lib))
        ptrs.append(allocate(lib))


def main():
    ptrs = []
    reused = generated_functions(released, ptrs)
    two_lines(released, ptrs)
    for lib in (released, held):
        ptrs.append(allocate(lib))
        ptrs.append(Model().forward(lib, 30))
        ptrs.append(next(generator(lib)))
        ptrs.append((lambda: allocate(lib))())
    worker = threading.Thread(target=lambda: ptrs.append(Model().forward(released, 3)))
    worker.start()
    worker.join()
    for p in ptrs:
        if released.cudaFree(ctypes.c_void_p(p)) != 0:
            raise SystemExit("FAIL: cudaFree")
    with open(sys.argv[1], "w") as f:
        json.dump(expected, f)
    print(f"code objects made at a freed one's address: {reused}")
    print("OK python_stacks")


if __name__ == "__main__":
    main()
