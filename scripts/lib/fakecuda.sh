# Build fakecuda (tests/fakecuda, the CPU stand-in for CUDA) into "$1" and the named test
# programs (tests/programs/NAME.c) next to it, over the shared runtime, as tests/build.rs builds
# them: the driver (libcuda.so.1) and a runtime (libcudart.so.13) that reaches it only through
# cuGetProcAddress_v2. Sourced by scripts that run without a GPU.
build_fakecuda() {
    local out="$1"
    shift
    local cc=${CC:-cc}
    mkdir -p "$out"
    $cc -O1 -shared -fPIC -fvisibility=hidden -Wl,-Bsymbolic -Wl,-soname,libcuda.so.1 \
        -Itests/fakecuda/include -o "$out/libcuda.so.1" tests/fakecuda/fakecuda.c -lpthread
    ln -sf libcuda.so.1 "$out/libcuda.so"
    $cc -O1 -shared -fPIC -fvisibility=hidden -Wl,-Bsymbolic -Wl,-soname,libcudart.so.13 \
        -Itests/fakecuda/include -o "$out/libcudart.so.13" tests/fakecuda/cudart.c -ldl -lpthread
    local prog
    for prog in "$@"; do
        $cc -O1 -Itests/fakecuda/include -Itests/programs -o "$out/$prog" "tests/programs/$prog.c" \
            tests/programs/slow_fill_fake.c -L"$out" -l:libcudart.so.13 -Wl,-rpath-link,"$out" \
            -lpthread
    done
}
