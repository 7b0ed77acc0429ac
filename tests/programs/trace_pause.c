/* cachealloc_trace_pause: allocation records paused and resumed around a program's own work
 * (a benchmark's switch). Blocks: "before" allocated before the pause and freed during it;
 * "during" allocated and freed while paused; "kept" allocated while paused and freed after it;
 * "after" allocated and freed after it. The trace's records are checked by
 * tests/tests/recording_pause.rs. Runs under the shim only (it needs the C API). Prints the
 * blocks' addresses as "block NAME ADDRESS". */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

int main(void) {
    int (*trace_pause)(int) = (int (*)(int))dlsym(RTLD_DEFAULT, "cachealloc_trace_pause");
    EXPECT(trace_pause != NULL, "the library does not export cachealloc_trace_pause");
    void *before, *during, *kept, *after;
    CHECK(cudaMalloc(&before, 1 << 20));
    EXPECT(trace_pause(1) == 0, "not paused before");
    EXPECT(trace_pause(1) == 1, "paused");
    CHECK(cudaMalloc(&during, 1 << 20));
    CHECK(cudaFree(before));
    CHECK(cudaMalloc(&kept, 3 << 20));
    CHECK(cudaFree(during));
    EXPECT(trace_pause(0) == 1, "resumed from a pause");
    CHECK(cudaMalloc(&after, 1 << 20));
    CHECK(cudaFree(kept));
    CHECK(cudaFree(after));
    printf("block before %lu\nblock during %lu\nblock kept %lu\nblock after %lu\n",
           (unsigned long)(uintptr_t)before, (unsigned long)(uintptr_t)during,
           (unsigned long)(uintptr_t)kept, (unsigned long)(uintptr_t)after);
    printf("OK trace_pause\n");
    return 0;
}
