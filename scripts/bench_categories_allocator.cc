// PyTorch's CPU allocator replaced by one that takes its memory from cudaMalloc/cudaFree, for
// scripts/bench_categories.py: on a machine without a GPU, under LD_PRELOAD=libcachealloc.so
// over fakecuda (whose device memory is host memory), every CPU tensor's storage is then a block
// of the shim's, so a CPU training step goes through the shim's allocation path as a GPU step
// does — each allocation recorded, with its Python stack and its thread's scope.
//
// Built by scripts/bench-categories against the installed torch's headers and libc10; loaded
// with ctypes. `bench_shim_cpu_allocator(1)` installs it (tensors made before keep their own
// deleter), `(0)` puts PyTorch's back; returns 0, or -1 when no cudaMalloc can be found.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>

#include <new>

namespace {

using MallocFn = int (*)(void**, size_t);
using FreeFn = int (*)(void*);

MallocFn cuda_malloc = nullptr;
FreeFn cuda_free = nullptr;

void release(void* p) {
  if (p != nullptr) {
    cuda_free(p);
  }
}

struct ShimAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (n > 0 && cuda_malloc(&p, n) != 0) {
      throw std::bad_alloc();
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

ShimAllocator shim_allocator;
c10::Allocator* previous = nullptr;

}  // namespace

extern "C" int bench_shim_cpu_allocator(int on) {
  if (cuda_malloc == nullptr) {
    cuda_malloc = reinterpret_cast<MallocFn>(dlsym(RTLD_DEFAULT, "cudaMalloc"));
    cuda_free = reinterpret_cast<FreeFn>(dlsym(RTLD_DEFAULT, "cudaFree"));
    if (cuda_malloc == nullptr || cuda_free == nullptr) {
      cuda_malloc = nullptr;
      return -1;
    }
  }
  if (on != 0) {
    if (previous == nullptr) {
      previous = c10::GetCPUAllocator();
    }
    c10::SetCPUAllocator(&shim_allocator, 255);
  } else if (previous != nullptr) {
    c10::SetCPUAllocator(previous, 255);
  }
  return 0;
}
