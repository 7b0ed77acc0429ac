/* PyTorch's allocator settings changed at run time (torch.cuda.memory._set_allocator_settings),
 * through the library's C API as the Python integration calls it:
 *  - settings given before the device's pool exists apply to the pool when it is made
 *    (roundup_power2_divisions:4 rounds 84 MiB up to 96 MiB, as the default memory pool's
 *    used-memory attribute shows: PyTorch's allocated bytes, its stream-ordered memory);
 *  - an empty string resets them, as PyTorch's parser does;
 *  - a bad value is refused (cudaErrorInvalidValue, with a message naming the key) and
 *    changes nothing.
 * Runs under the shim only (it needs the C API). Usage: allocator_settings */
#include <dlfcn.h>
#include <stdint.h>

#include "common.h"

#define MIB ((size_t)1 << 20)

static uint64_t used(cudaMemPool_t pool) {
    uint64_t value = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &value));
    return value;
}

int main(void) {
    int (*set)(const char *) = (int (*)(const char *))dlsym(RTLD_DEFAULT, "cachealloc_set_allocator_settings");
    if (!set) {
        printf("OK allocator_settings (skipped: needs cachealloc)\n");
        return 0;
    }
    CHECK(cudaFree(0)); /* the library starts; no pool yet */
    EXPECT(set("roundup_power2_divisions:4") == 0, "the settings were refused");
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t before = used(pool);
    void *a, *b;
    CHECK(cudaMallocAsync(&a, 84 * MIB, 0)); /* PyTorch's are stream-ordered: the pool's used memory */
    EXPECT(used(pool) - before == 96 * MIB, "84 MiB took %llu MiB under roundup_power2_divisions:4",
           (unsigned long long)((used(pool) - before) / MIB));
    EXPECT(set("max_split_size_mb:2") == cudaErrorInvalidValue, "a split limit of 2 MiB was taken");
    EXPECT(set("") == 0, "an empty string was refused");
    before = used(pool);
    CHECK(cudaMallocAsync(&b, 84 * MIB, 0));
    EXPECT(used(pool) - before == 84 * MIB, "after the reset 84 MiB took %llu MiB",
           (unsigned long long)((used(pool) - before) / MIB));
    CHECK(cudaFreeAsync(a, 0));
    CHECK(cudaFreeAsync(b, 0));
    printf("OK allocator_settings\n");
    return 0;
}
