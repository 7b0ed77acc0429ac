// Which driver call of a move of expandable-segment memory costs, and how that scales (design.md,
// "Recycling drifts on variable shapes"). For mappings of 2 to 256 MiB: the medians of REPS
// rounds of cuMemRetainAllocationHandle, cuMemMap of the retained memory at a second place,
// cuMemSetAccess there and cuMemUnmap, in microseconds (cuMemCreate once). Then 64 mappings of
// 16 MiB moved into one place of 1 GiB (as a map of the recorded Llama's logits), granted access
// in one cuMemSetAccess over the whole run, or in one per mapping.
//   nvcc -O2 -o map_parts scripts/gpu/map_parts.cu -lcuda && ./map_parts [REPS]
// H200, driver 580.159.04 (2026-11-27): the map costs 1 µs and cuMemSetAccess 27-30 µs (48-51
// for 256 MiB), unmap 18-26; the 64 moves cost 2.0-2.1 ms either way: cuMemSetAccess costs per
// mapping it covers, not per call.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CHECK(x) do { CUresult rc_ = (x); if (rc_ != CUDA_SUCCESS) { printf("%s: %d\n", #x, rc_); exit(1); } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 20;
    cudaFree(0);
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemAccessDesc acc = {};
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t mib = 1 << 20;
    const size_t sizes[] = {2, 8, 16, 64, 256};
    for (size_t s : sizes) {
        size_t size = s * mib;
        CUdeviceptr r;
        CHECK(cuMemAddressReserve(&r, 4 * size, 0, 0, 0));
        CUmemGenericAllocationHandle h;
        double t0 = now_us();
        CHECK(cuMemCreate(&h, size, &prop, 0));
        double create = now_us() - t0;
        CHECK(cuMemMap(r, size, 0, h, 0));
        CHECK(cuMemSetAccess(r, size, &acc, 1));
        std::vector<double> retain, map, access, unmap, map_ro;
        for (int i = 0; i < reps; i++) {
            CUmemGenericAllocationHandle a;
            t0 = now_us();
            CHECK(cuMemRetainAllocationHandle(&a, (void *)r));
            retain.push_back(now_us() - t0);
            t0 = now_us();
            CHECK(cuMemMap(r + size, size, 0, a, 0));
            map.push_back(now_us() - t0);
            CHECK(cuMemRelease(a));
            t0 = now_us();
            CHECK(cuMemSetAccess(r + size, size, &acc, 1));
            access.push_back(now_us() - t0);
            t0 = now_us();
            CHECK(cuMemUnmap(r + size, size));
            unmap.push_back(now_us() - t0);
        }
        printf("size_MiB=%zu create_us=%.1f retain_us=%.1f map_us=%.1f set_access_us=%.1f unmap_us=%.1f\n", s,
               create, med(retain), med(map), med(access), med(unmap));
        CHECK(cuMemUnmap(r, size));
        CHECK(cuMemRelease(h));
        CHECK(cuMemAddressFree(r, 4 * size));
    }
    // 64 mappings of 16 MiB moved into one place of 1 GiB: one set access, or one per mapping.
    size_t size = 16 * mib;
    int n = 64;
    CUdeviceptr r;
    CHECK(cuMemAddressReserve(&r, 2 * n * size, 0, 0, 0));
    for (int i = 0; i < n; i++) {
        CUmemGenericAllocationHandle h;
        CHECK(cuMemCreate(&h, size, &prop, 0));
        CHECK(cuMemMap(r + i * size, size, 0, h, 0));
        CHECK(cuMemRelease(h));
    }
    CHECK(cuMemSetAccess(r, n * size, &acc, 1));
    std::vector<double> one, each;
    for (int k = 0; k < reps; k++) {
        for (int mode = 0; mode < 2; mode++) {
            CUdeviceptr to = r + n * size;
            double t0 = now_us();
            for (int i = 0; i < n; i++) {
                CUmemGenericAllocationHandle a;
                CHECK(cuMemRetainAllocationHandle(&a, (void *)(r + i * size)));
                CHECK(cuMemMap(to + i * size, size, 0, a, 0));
                CHECK(cuMemRelease(a));
                if (mode == 1) CHECK(cuMemSetAccess(to + i * size, size, &acc, 1));
            }
            if (mode == 0) CHECK(cuMemSetAccess(to, n * size, &acc, 1));
            (mode == 0 ? one : each).push_back(now_us() - t0);
            for (int i = 0; i < n; i++) CHECK(cuMemUnmap(to + i * size, size));
        }
    }
    printf("moves=%d of 16 MiB: one_set_access_us=%.1f set_access_each_us=%.1f\n", n, med(one), med(each));
    return 0;
}
