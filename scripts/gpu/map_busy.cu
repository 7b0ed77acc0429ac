// What a move of expandable-segment memory costs in a training step rather than on an idle GPU
// (design.md, "Recycling drifts on variable shapes"): `map_cost.cu` times the driver's calls
// with nothing running, where a move (retain + map + release, one cuMemSetAccess per map) costs
// a few µs; on the recorded Llama ~25 moves a step cost ~2 ms. Two suspects, each timed here
// against the idle case, medians of REPS rounds in microseconds:
//   busy:  the same calls while a kernel keeps the GPU busy for SPIN_MS (does the driver wait
//          for the device, or for the queued work, before it changes the page tables?);
//   alive: the same calls with ALIVE other mappings of one allocation alive in the range (the
//          shim keeps up to 1 024 parked places; does the driver's cost grow with them?).
//   nvcc -O2 -o map_busy scripts/gpu/map_busy.cu -lcuda && ./map_busy [REPS] [SPIN_MS] [ALIVE]
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

__global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

struct Vmm {
    CUmemAllocationProp prop = {};
    CUmemAccessDesc access = {};
    size_t g = 0;
};

// A move as the shim makes one: the memory mapped at `from` mapped at `to` as well, then access
// granted to the new place; returns the microseconds the calls took.
static double move(const Vmm &v, CUdeviceptr from, CUdeviceptr to, size_t size) {
    double t0 = now_us();
    CUmemGenericAllocationHandle again;
    CHECK(cuMemRetainAllocationHandle(&again, (void *)from));
    CHECK(cuMemMap(to, size, 0, again, 0));
    CHECK(cuMemRelease(again));
    CHECK(cuMemSetAccess(to, size, &v.access, 1));
    return now_us() - t0;
}

// New memory mapped at `at`, as a map's fresh part is: create, map, release, grant access.
static double fresh(const Vmm &v, CUdeviceptr at, size_t size) {
    double t0 = now_us();
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, size, &v.prop, 0));
    CHECK(cuMemMap(at, size, 0, h, 0));
    CHECK(cuMemRelease(h));
    CHECK(cuMemSetAccess(at, size, &v.access, 1));
    return now_us() - t0;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 50;
    double spin_ms = argc > 2 ? atof(argv[2]) : 5.0;
    int alive = argc > 3 ? atoi(argv[3]) : 1000;
    cudaFree(0);
    Vmm v;
    v.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    v.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    v.prop.location.id = 0;
    CHECK(cuMemGetAllocationGranularity(&v.g, &v.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    v.access.location = v.prop.location;
    v.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // About 2 GHz (H100, H200): the spin's real length is measured and printed.
    long long cycles = (long long)(spin_ms * 2.0e6);
    const size_t size = 16ul << 20;  // a mapping of a map of 1 GiB in sixty-fourths
    size_t slots = 4 + (size_t)alive;
    CUdeviceptr range;
    CHECK(cuMemAddressReserve(&range, slots * size, v.g, 0, 0));
    CUdeviceptr home = range, to = range + size, fresh_at = range + 2 * size;
    fresh(v, home, size);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    std::vector<double> idle_move, busy_move, idle_fresh, busy_fresh, alive_move, alive_fresh, spin_alone;
    for (int r = 0; r < reps; r++) {
        // The spin alone: how long the kernel keeps the GPU busy.
        double t0 = now_us();
        spin<<<1, 1, 0, s>>>(cycles);
        cudaStreamSynchronize(s);
        spin_alone.push_back(now_us() - t0);
        // Idle GPU.
        idle_move.push_back(move(v, home, to, size));
        CHECK(cuMemUnmap(to, size));
        idle_fresh.push_back(fresh(v, fresh_at, size));
        CHECK(cuMemUnmap(fresh_at, size));
        // Busy GPU: the kernel is queued first, then the calls are timed.
        spin<<<1, 1, 0, s>>>(cycles);
        busy_move.push_back(move(v, home, to, size));
        busy_fresh.push_back(fresh(v, fresh_at, size));
        cudaStreamSynchronize(s);
        CHECK(cuMemUnmap(to, size));
        CHECK(cuMemUnmap(fresh_at, size));
    }
    // ALIVE parked places: the home memory mapped at ALIVE more places.
    for (int i = 0; i < alive; i++) move(v, home, range + (4 + i) * size, size);
    for (int r = 0; r < reps; r++) {
        alive_move.push_back(move(v, home, to, size));
        CHECK(cuMemUnmap(to, size));
        alive_fresh.push_back(fresh(v, fresh_at, size));
        CHECK(cuMemUnmap(fresh_at, size));
    }
    printf("map_busy mapping_MiB=%zu spin_ms=%.2f alive=%d idle_move_us=%.1f busy_move_us=%.1f "
           "idle_fresh_us=%.1f busy_fresh_us=%.1f alive_move_us=%.1f alive_fresh_us=%.1f\n",
           size >> 20, median(spin_alone) / 1000, alive, median(idle_move), median(busy_move),
           median(idle_fresh), median(busy_fresh), median(alive_move), median(alive_fresh));
    return 0;
}
