// What mapping costs: CUDA's virtual memory calls for 2 MiB and 20 MiB, the way cachealloc's
// expandable segments make them (one cuMemCreate + cuMemMap per 2 MiB granule, one
// cuMemSetAccess per map; per granule cuMemUnmap), against one handle for the whole size and
// against cudaMalloc/cudaFree of the same size; and granule mappings unmapped by one
// cuMemUnmap over their whole run (the driver unmaps adjacent whole mappings in one call).
// Medians of REPS rounds, in microseconds.
//   nvcc -O2 -o map_cost scripts/gpu/map_cost.cu -lcuda && ./map_cost [REPS]
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { printf("%s: %d\n", #x, r); exit(1); } } while (0)

static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

// cachealloc's way before MIN_MAPPING: a handle per granule, released once mapped, then access
// to the whole run in one call.
static void map_granules(CUdeviceptr range, size_t n, size_t g, const CUmemAllocationProp &prop,
                         const CUmemAccessDesc &access) {
    for (size_t i = 0; i < n; i++) {
        CUmemGenericAllocationHandle h;
        CHECK(cuMemCreate(&h, g, &prop, 0));
        CHECK(cuMemMap(range + i * g, g, 0, h, 0));
        CHECK(cuMemRelease(h));
    }
    CHECK(cuMemSetAccess(range, n * g, &access, 1));
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 200;
    cudaFree(0);
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t g = 0;
    CHECK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUdeviceptr range;
    size_t range_size = 256 * g;
    CHECK(cuMemAddressReserve(&range, range_size, g, 0, 0));
    printf("granularity %zu bytes\n", g);
    for (size_t size : {2ul << 20, 20ul << 20, 200ul << 20}) {
        size_t n = size / g;
        std::vector<double> map_per_granule, unmap_per_granule, map_one, unmap_one, cmalloc, cfree;
        std::vector<double> remap_move, create_only, release_only, unmap_run;
        std::vector<double> alias_map, alias_map_no_access, alias_unmap;
        for (int r = 0; r < reps; r++) {
            double t0 = now_us();
            map_granules(range, n, g, prop, access);
            double t1 = now_us();
            CHECK(cuCtxSynchronize());
            for (size_t i = 0; i < n; i++) CHECK(cuMemUnmap(range + i * g, g));
            double t2 = now_us();
            map_per_granule.push_back(t1 - t0);
            unmap_per_granule.push_back(t2 - t1);
            // The same mappings, unmapped by one call over their run.
            map_granules(range, n, g, prop, access);
            CHECK(cuCtxSynchronize());
            t0 = now_us();
            CHECK(cuMemUnmap(range, size));
            t1 = now_us();
            unmap_run.push_back(t1 - t0);
            // Moving memory: handles kept, unmapped at one place and mapped at another (no
            // cuMemCreate or cuMemRelease).
            std::vector<CUmemGenericAllocationHandle> hs(n);
            t0 = now_us();
            for (size_t i = 0; i < n; i++) CHECK(cuMemCreate(&hs[i], g, &prop, 0));
            t1 = now_us();
            create_only.push_back(t1 - t0);
            for (size_t i = 0; i < n; i++) CHECK(cuMemMap(range + i * g, g, 0, hs[i], 0));
            CHECK(cuMemSetAccess(range, size, &access, 1));
            CHECK(cuCtxSynchronize());
            t0 = now_us();
            for (size_t i = 0; i < n; i++) CHECK(cuMemUnmap(range + i * g, g));
            for (size_t i = 0; i < n; i++) CHECK(cuMemMap(range + (n + i) * g, g, 0, hs[i], 0));
            CHECK(cuMemSetAccess(range + n * g, size, &access, 1));
            t1 = now_us();
            remap_move.push_back(t1 - t0);
            for (size_t i = 0; i < n; i++) CHECK(cuMemUnmap(range + (n + i) * g, g));
            t0 = now_us();
            for (size_t i = 0; i < n; i++) CHECK(cuMemRelease(hs[i]));
            t1 = now_us();
            release_only.push_back(t1 - t0);
            // One handle for the whole size.
            t0 = now_us();
            CUmemGenericAllocationHandle h;
            CHECK(cuMemCreate(&h, size, &prop, 0));
            CHECK(cuMemMap(range, size, 0, h, 0));
            CHECK(cuMemRelease(h));
            CHECK(cuMemSetAccess(range, size, &access, 1));
            t1 = now_us();
            CHECK(cuCtxSynchronize());
            CHECK(cuMemUnmap(range, size));
            t2 = now_us();
            map_one.push_back(t1 - t0);
            unmap_one.push_back(t2 - t1);
            // Moving memory as the shim does (Note [Moving memory instead of unmapping it]): the
            // memory of one mapping mapped at a second place (retain its handle, map, release
            // the reference, grant access), then that second place unmapped while the first
            // keeps the memory; and the same map without its own cuMemSetAccess (the shim grants
            // access to a whole map's run in one call).
            CHECK(cuMemCreate(&h, size, &prop, 0));
            CHECK(cuMemMap(range, size, 0, h, 0));
            CHECK(cuMemRelease(h));
            CHECK(cuMemSetAccess(range, size, &access, 1));
            CHECK(cuCtxSynchronize());
            t0 = now_us();
            CUmemGenericAllocationHandle again;
            CHECK(cuMemRetainAllocationHandle(&again, (void *)range));
            CHECK(cuMemMap(range + size, size, 0, again, 0));
            CHECK(cuMemRelease(again));
            CHECK(cuMemSetAccess(range + size, size, &access, 1));
            t1 = now_us();
            CHECK(cuCtxSynchronize());
            CHECK(cuMemUnmap(range + size, size));
            t2 = now_us();
            alias_map.push_back(t1 - t0);
            alias_unmap.push_back(t2 - t1);
            t0 = now_us();
            CHECK(cuMemRetainAllocationHandle(&again, (void *)range));
            CHECK(cuMemMap(range + size, size, 0, again, 0));
            CHECK(cuMemRelease(again));
            t1 = now_us();
            alias_map_no_access.push_back(t1 - t0);
            CHECK(cuMemUnmap(range + size, size));
            CHECK(cuMemUnmap(range, size));
            // cudaMalloc / cudaFree.
            void *p;
            t0 = now_us();
            cudaMalloc(&p, size);
            t1 = now_us();
            cudaFree(p);
            t2 = now_us();
            cmalloc.push_back(t1 - t0);
            cfree.push_back(t2 - t1);
        }
        printf("map_cost size_MiB=%zu granule_handles_map_us=%.1f granule_handles_unmap_us=%.1f "
               "one_handle_map_us=%.1f one_handle_unmap_us=%.1f cudaMalloc_us=%.1f cudaFree_us=%.1f "
               "create_only_us=%.1f release_only_us=%.1f move_kept_handles_us=%.1f "
               "granule_handles_unmap_one_call_us=%.1f alias_map_us=%.1f "
               "alias_map_without_access_us=%.1f alias_unmap_us=%.1f\n",
               size >> 20, median(map_per_granule), median(unmap_per_granule), median(map_one),
               median(unmap_one), median(cmalloc), median(cfree), median(create_only),
               median(release_only), median(remap_move), median(unmap_run), median(alias_map),
               median(alias_map_no_access), median(alias_unmap));
    }
    return 0;
}
