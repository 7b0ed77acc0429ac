/* CUDA's virtual memory management API used directly, as JAX/XLA and expandable segments use
 * it: granularity, a reservation of 64 granules, physical memory created, mapped and given
 * access, patterns written and read back with the runtime's memset and memcpy (also across
 * adjacent mappings), unmapping, release, and the reservation freed; then misuse, each with
 * the error code CUDA 13.0 gives (measured on an H100, where this program passes too): a
 * mapping outside the reservation, unaligned or over another mapping (invalid value), at an
 * offset or of part of its memory (not supported), part of a mapping unmapped or given access,
 * a reservation freed while mapped, memory created beyond the device's capacity (out of
 * memory), a handle released twice. cudaMemGetInfo proves the accounting: physical memory
 * counts from cuMemCreate until it is both released and unmapped.
 *
 * The driver's functions are found both ways a program finds them, dlsym on libcuda.so.1 (as
 * XLA does) and the runtime's cudaGetDriverEntryPoint (the driver's cuGetProcAddress table),
 * which must agree. Arguments: the expected granularity in KiB (default 2048, CUDA's); then
 * "touch" to write to mapped memory before access is granted, which must fault (SIGSEGV: in
 * fakecuda device memory is host memory, protected as a GPU's page tables protect it).
 * Prints "OK vmm". */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include "common.h"

#define CU(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) \
    FAIL("%s:%d: %s returned %d", __FILE__, __LINE__, #call, (int)r_); } while (0)
/* A call that must fail with `code`. */
#define CU_ERR(code, call) do { CUresult r_ = (call); if (r_ != (code)) \
    FAIL("%s:%d: %s returned %d, not %s", __FILE__, __LINE__, #call, (int)r_, #code); } while (0)

static CUresult (*p_granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
static CUresult (*p_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*p_address_free)(CUdeviceptr, size_t);
static CUresult (*p_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
static CUresult (*p_release)(CUmemGenericAllocationHandle);
static CUresult (*p_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
static CUresult (*p_unmap)(CUdeviceptr, size_t);
static CUresult (*p_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
static CUresult (*p_get_access)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
static CUresult (*p_retain)(CUmemGenericAllocationHandle *, void *);
static CUresult (*p_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
static CUresult (*p_pointer_attribute)(void *, CUpointer_attribute, CUdeviceptr);

/* `name` through dlsym (`exported`) and through the runtime's entry points, the same function. */
static void *resolve(void *libcuda, const char *name, const char *exported, int version) {
    void *by_dlsym = dlsym(libcuda, exported);
    EXPECT(by_dlsym != NULL, "dlsym(%s): %s", exported, dlerror());
    void *by_entry = NULL;
    enum cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    CHECK(cudaGetDriverEntryPointByVersion(name, &by_entry, (unsigned)version, cudaEnableDefault, &status));
    EXPECT(status == cudaDriverEntryPointSuccess && by_entry == by_dlsym,
           "%s: entry point %p (status %d), dlsym %p", name, by_entry, (int)status, by_dlsym);
    /* The VMM API is CUDA 10.2's (cuMemRetainAllocationHandle 11.0's): older, not found. (The
     * runtime's own answer differs: CUDA 13.0's is cudaSuccess, fakecuda's an error.) */
    if (version < 10020) return by_dlsym;
    by_entry = (void *)1;
    (void)cudaGetDriverEntryPointByVersion(name, &by_entry, (unsigned)version - 10, cudaEnableDefault, &status);
    (void)cudaGetLastError();
    EXPECT(by_entry == NULL && status == cudaDriverEntryPointVersionNotSufficent, "%s at %d: %p, status %d", name,
           version - 10, by_entry, (int)status);
    return by_dlsym;
}

#define RESOLVE(var, name, exported, version) do { void *f_ = resolve(libcuda, name, exported, version); \
    memcpy(&var, &f_, sizeof f_); } while (0)

static size_t free_memory(void) {
    size_t free_bytes, total;
    CHECK(cudaMemGetInfo(&free_bytes, &total));
    return free_bytes;
}

static void *at(CUdeviceptr p) { return (void *)(uintptr_t)p; }

/* Fill `bytes` at `p` with `value` (the runtime's memset, through the driver). */
static void fill(CUdeviceptr p, unsigned char value, size_t bytes) {
    CHECK(cudaMemset(at(p), value, bytes));
    CHECK(cudaDeviceSynchronize());
}

static void expect_pattern(CUdeviceptr p, unsigned char value, size_t bytes, const char *what) {
    long bad = first_wrong_byte(at(p), value, bytes);
    EXPECT(bad < 0, "%s: byte %ld is not 0x%02x", what, bad, value);
}

int main(int argc, char **argv) {
    size_t expected_kb = argc > 1 ? (size_t)atol(argv[1]) : 2048;
    int touch = argc > 2 && strcmp(argv[2], "touch") == 0;
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    EXPECT(libcuda != NULL, "dlopen libcuda.so.1: %s", dlerror());

    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;

    /* Before anything initialized the driver: CUDA_ERROR_NOT_INITIALIZED. (Skipped when
     * something preloaded may have initialized it already.) */
    if (!getenv("LD_PRELOAD")) {
        void *f = dlsym(libcuda, "cuMemGetAllocationGranularity");
        EXPECT(f != NULL, "dlsym(cuMemGetAllocationGranularity)");
        memcpy(&p_granularity, &f, sizeof f);
        size_t g = 0;
        CU_ERR(CUDA_ERROR_NOT_INITIALIZED, p_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    }

    CHECK(cudaFree(0)); /* the runtime's context, current on this thread */
    RESOLVE(p_granularity, "cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity", 10020);
    RESOLVE(p_reserve, "cuMemAddressReserve", "cuMemAddressReserve", 10020);
    RESOLVE(p_address_free, "cuMemAddressFree", "cuMemAddressFree", 10020);
    RESOLVE(p_create, "cuMemCreate", "cuMemCreate", 10020);
    RESOLVE(p_release, "cuMemRelease", "cuMemRelease", 10020);
    RESOLVE(p_map, "cuMemMap", "cuMemMap", 10020);
    RESOLVE(p_unmap, "cuMemUnmap", "cuMemUnmap", 10020);
    RESOLVE(p_set_access, "cuMemSetAccess", "cuMemSetAccess", 10020);
    RESOLVE(p_get_access, "cuMemGetAccess", "cuMemGetAccess", 10020);
    RESOLVE(p_retain, "cuMemRetainAllocationHandle", "cuMemRetainAllocationHandle", 11000);
    RESOLVE(p_address_range, "cuMemGetAddressRange", "cuMemGetAddressRange_v2", 3020);
    RESOLVE(p_pointer_attribute, "cuPointerGetAttribute", "cuPointerGetAttribute", 4000);

    /* Granularity: the same minimum and recommended, as expected. */
    size_t g = 0, recommended = 0;
    CU(p_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CU(p_granularity(&recommended, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    printf("granularity %zu recommended %zu\n", g, recommended);
    EXPECT(g == expected_kb << 10 && recommended == g, "granularity %zu (recommended %zu), expected %zu KiB", g,
           recommended, expected_kb);
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_granularity(&g, NULL, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_granularity(&g, &prop, (CUmemAllocationGranularity_flags)7));
    /* Memory of no device, or of a device that does not exist. */
    CUmemAllocationProp bad = prop;
    bad.location.type = CU_MEM_LOCATION_TYPE_INVALID;
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_create(&(CUmemGenericAllocationHandle){0}, g, &bad, 0));
    bad = prop;
    bad.location.id = 99;
    CU_ERR(CUDA_ERROR_INVALID_DEVICE, p_create(&(CUmemGenericAllocationHandle){0}, g, &bad, 0));

    CUmemAccessDesc rw;
    memset(&rw, 0, sizeof rw);
    rw.location = prop.location;
    rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

    /* A reservation of 64 granules (sizes must be multiples of the granularity). */
    const size_t free0 = free_memory();
    CUdeviceptr base = 0;
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_reserve(&base, g + 512, 0, 0, 0));
    CU(p_reserve(&base, 64 * g, 0, 0, 0));
    EXPECT(base != 0 && base % g == 0, "reservation at %#llx", (unsigned long long)base);
    EXPECT(free_memory() == free0, "a reservation took device memory");

    /* One mapping of 3 granules: counted from cuMemCreate; no access until cuMemSetAccess. */
    CUmemGenericAllocationHandle whole = 0;
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_create(&whole, g / 2, &prop, 0));
    CU(p_create(&whole, 3 * g, &prop, 0));
    EXPECT(free_memory() == free0 - 3 * g, "cuMemCreate of 3 granules: free %zu, was %zu", free_memory(), free0);
    CU(p_map(base, 3 * g, 0, whole, 0));
    unsigned long long flags = 99;
    CU(p_get_access(&flags, &prop.location, base + g));
    EXPECT(flags == CU_MEM_ACCESS_FLAGS_PROT_NONE, "access before cuMemSetAccess: %llu", flags);
    EXPECT(cudaMemset(at(base), 1, g) != cudaSuccess, "a memset without access succeeded");
    if (touch) {
        printf("touching mapped memory without access\n");
        fflush(stdout);
        *(volatile char *)at(base + g) = 1;
        FAIL("mapped memory without access was writable");
    }
    (void)cudaGetLastError();
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_set_access(base, g, &rw, 1)); /* part of the mapping */
    CU(p_set_access(base, 3 * g, &rw, 1));
    CU(p_get_access(&flags, &prop.location, base + 2 * g));
    EXPECT(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "access after cuMemSetAccess: %llu", flags);
    for (int i = 0; i < 3; i++) fill(base + (size_t)i * g, (unsigned char)(0x40 + i), g);
    for (int i = 0; i < 3; i++) expect_pattern(base + (size_t)i * g, (unsigned char)(0x40 + i), g, "3-granule mapping");
    CUdeviceptr range_base = 0;
    size_t range_size = 0;
    CU(p_address_range(&range_base, &range_size, base + g + 5));
    EXPECT(range_base == base && range_size == 3 * g, "address range %#llx+%zu", (unsigned long long)range_base,
           range_size);
    int ordinal = -1;
    CU(p_pointer_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, base + 7));
    EXPECT(ordinal == 0, "device ordinal %d", ordinal);
    /* Part of a mapping cannot be unmapped. */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_unmap(base + g, g));
    /* Released while mapped: the memory lives on, with its data, until the unmap. */
    CU(p_release(whole));
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_release(whole));
    EXPECT(free_memory() == free0 - 3 * g, "released but mapped memory already returned");
    expect_pattern(base + g, 0x41, g, "released but still mapped");
    CU(p_unmap(base, 3 * g));
    EXPECT(free_memory() == free0, "released and unmapped memory not returned: free %zu, was %zu", free_memory(),
           free0);
    CU_ERR(CUDA_ERROR_NOT_FOUND, p_address_range(&range_base, &range_size, base + g)); /* reserved only */

    /* One mapping per granule, 3 adjacent ones at granule 10: access and copies across them. */
    CUmemGenericAllocationHandle h[3];
    const CUdeviceptr row = base + 10 * g;
    for (int i = 0; i < 3; i++) {
        CU(p_create(&h[i], g, &prop, 0));
        CU(p_map(row + (size_t)i * g, g, 0, h[i], 0));
    }
    CU(p_set_access(row, 3 * g, &rw, 1));
    fill(row, 0x5a, 3 * g);
    expect_pattern(row, 0x5a, 3 * g, "across 3 mappings");
    for (int i = 0; i < 3; i++) fill(row + (size_t)i * g, (unsigned char)(0x60 + i), g);
    CU(p_address_range(&range_base, &range_size, row + g + 1));
    EXPECT(range_base == row + g && range_size == g, "address range of the middle mapping");
    CUmemGenericAllocationHandle retained = 0;
    CU(p_retain(&retained, at(row + 2 * g + 100)));
    EXPECT(retained == h[2], "retained handle %llu, not %llu", retained, h[2]);
    CU(p_release(retained));

    /* Misuse, each with CUDA's code. */
    CUmemGenericAllocationHandle spare = 0;
    CU(p_create(&spare, g, &prop, 0));
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_map(base + 64 * g, g, 0, spare, 0));        /* past the reservation */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_map(base + 20 * g + 4096, g, 0, spare, 0)); /* unaligned */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_map(base + 20 * g, g, 0, spare, 1));        /* flags */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_map(row + g, g, 0, spare, 0));              /* over a mapping */
    CU_ERR(CUDA_ERROR_NOT_SUPPORTED, p_map(base + 20 * g, g, g, spare, 0));        /* at an offset */
    CU_ERR(CUDA_ERROR_NOT_SUPPORTED, p_map(base + 20 * g, 2 * g, 0, spare, 0));    /* more than the memory */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_unmap(row, g / 2));                         /* part of a mapping */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_unmap(row + g / 2, g));                     /* cutting two */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_unmap(base + 64 * g, g));                   /* outside the reservation */
    CU(p_unmap(base + 30 * g, g));                                                 /* nothing mapped: fine */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_set_access(row, 4 * g, &rw, 1));            /* over a gap */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_address_free(base, 64 * g));                /* still mapped */
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_address_free(base, 32 * g));                /* not the whole reservation */
    CUmemGenericAllocationHandle huge = 0;
    size_t beyond = (free_memory() / g + 1) * g;
    CU_ERR(CUDA_ERROR_OUT_OF_MEMORY, p_create(&huge, beyond, &prop, 0));
    /* Mapped twice; released while mapped, its handle still maps it; unmapped with a gap
     * between the two mappings, in one call. */
    CU(p_map(base + 20 * g, g, 0, spare, 0));
    CU(p_release(spare));
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_release(spare)); /* twice */
    CU(p_map(base + 22 * g, g, 0, spare, 0));
    CU(p_set_access(base + 22 * g, g, &rw, 1));
    fill(base + 22 * g, 0x77, g);
    CU(p_unmap(base + 20 * g, 3 * g));

    /* The middle granule unmapped: its neighbours keep their data; it is gone from the device
     * ranges; mapped again (its handle still held), it has its data back. */
    CU(p_unmap(row + g, g));
    expect_pattern(row, 0x60, g, "first granule after unmapping the middle one");
    expect_pattern(row + 2 * g, 0x62, g, "last granule after unmapping the middle one");
    EXPECT(cudaMemset(at(row + g), 1, g) != cudaSuccess, "a memset of an unmapped granule succeeded");
    EXPECT(cudaMemset(at(row), 1, 3 * g) != cudaSuccess, "a memset across a hole succeeded");
    (void)cudaGetLastError();
    CU(p_map(row + g, g, 0, h[1], 0));
    CU(p_set_access(row + g, g, &rw, 1));
    expect_pattern(row + g, 0x61, g, "the middle granule mapped again");

    /* Memory returns only when both released and unmapped. */
    EXPECT(free_memory() == free0 - 3 * g, "3 granules: free %zu, was %zu", free_memory(), free0);
    CU(p_unmap(row, 3 * g)); /* adjacent whole mappings together */
    EXPECT(free_memory() == free0 - 3 * g, "unmapped but not released memory returned");
    for (int i = 0; i < 3; i++) CU(p_release(h[i]));
    EXPECT(free_memory() == free0, "released and unmapped memory not returned: free %zu, was %zu", free_memory(),
           free0);
    CU(p_address_free(base, 64 * g));
    CU_ERR(CUDA_ERROR_INVALID_VALUE, p_address_free(base, 64 * g));

    /* A reservation larger than the device (1.125 times 80 GB, as a caching allocator makes)
     * costs nothing. */
    size_t large = ((size_t)90000000000ULL / g + 1) * g;
    CUdeviceptr far = 0;
    CU(p_reserve(&far, large, 0, 0, 0));
    CU(p_address_free(far, large));
    EXPECT(free_memory() == free0, "free %zu at the end, was %zu", free_memory(), free0);

    printf("OK vmm\n");
    return 0;
}
