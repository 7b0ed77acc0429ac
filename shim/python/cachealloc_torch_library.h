// The preloaded library as cachealloc's allocator for PyTorch sees it: the functions of its C
// API it calls (cachealloc's `ffi/c_api`), found when the allocator is installed, and what it
// builds from their answers (pool checkpoints, the segments of a snapshot). Included by
// cachealloc_torch_allocator.cpp.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <dlfcn.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_set>

namespace cachealloc_torch {

using namespace c10::cuda::CUDACachingAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;

// The preloaded library's C API (cachealloc's ffi/c_api): found at installation.
struct Library {
  using Address = void (*)(void*, uint64_t);
  using Block = void (*)(void*, uint64_t, uint64_t, uint64_t);
  void* (*checkpoint)(int, uint64_t) = nullptr;
  void (*checkpoint_drop)(void*) = nullptr;
  int (*restore)(const void*, Address, Block, void*) = nullptr;
  int (*live_blocks)(int, uint64_t, Address, void*) = nullptr;
  int (*record_stream)(uint64_t, size_t) = nullptr;
  int (*mem_pool_retain)(int, uint64_t, unsigned, void*, void*) = nullptr;
  int (*mem_pool_use_count)(int, uint64_t) = nullptr;
  int (*graph_pool_retain)(int, uint64_t) = nullptr;
  int (*graph_pool_release)(int, uint64_t) = nullptr;
  using Fields = void (*)(void*, const uint64_t*);
  int (*segments_walk)(int, Fields, Fields, void*) = nullptr;
  // `cudaFreeAsync` of a block of the library's pools; `not_pooled` for other memory.
  int (*free_async)(void*, cudaStream_t) = nullptr;
  static constexpr int not_pooled = -1;

  bool load() {
    return find(checkpoint, "cachealloc_pool_checkpoint") &&
        find(checkpoint_drop, "cachealloc_pool_checkpoint_drop") &&
        find(restore, "cachealloc_pool_restore") &&
        find(live_blocks, "cachealloc_pool_live_blocks") &&
        find(record_stream, "cachealloc_record_stream") &&
        find(mem_pool_retain, "cachealloc_mem_pool_retain") &&
        find(mem_pool_use_count, "cachealloc_mem_pool_use_count") &&
        find(graph_pool_retain, "cachealloc_graph_pool_retain") &&
        find(graph_pool_release, "cachealloc_graph_pool_release") &&
        find(segments_walk, "cachealloc_segments_walk") &&
        find(free_async, "cachealloc_free_async");
  }

 private:
  template <typename F>
  static bool find(F& fn, const char* name) {
    fn = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
    return fn != nullptr;
  }
};

inline Library library;

// The library's name for PyTorch's pool id (the Python integration's `pool_key`).
inline uint64_t pool_key(MempoolId_t id) {
  return ((id.first & 0xFFFFFFFFull) << 32) | (id.second & 0xFFFFFFFFull);
}

// A pool's checkpoint: the library's, released with this.
struct PoolState : AllocatorState {
  explicit PoolState(void* handle) : handle(handle) {}
  ~PoolState() override {
    library.checkpoint_drop(handle);
  }
  PoolState(const PoolState&) = delete;
  PoolState& operator=(const PoolState&) = delete;
  void* handle;
};

// Append to `info` the segments of `device`'s pools (only those of `pool` unless it is
// (0, 0)) with their blocks, each allocated block with the context `context_of` gives its
// address (Note [PyTorch's own contexts]).
inline void add_segments(DeviceIndex device, MempoolId_t pool,
                         const std::function<std::shared_ptr<c10::GatheredContext>(void*)>& context_of,
                         SnapshotInfo& info) {
  struct Walk {
    const std::function<std::shared_ptr<c10::GatheredContext>(void*)>* context_of;
    DeviceIndex device;
    MempoolId_t pool;
    SnapshotInfo* info;
    bool keep = false;
  } walk{&context_of, device, pool, &info};
  auto segment = [](void* context, const uint64_t* f) {
    auto* w = static_cast<Walk*>(context);
    MempoolId_t owner{static_cast<c10::CaptureId_t>(f[2]), static_cast<c10::CaptureId_t>(f[3])};
    w->keep = (w->pool.first == 0 && w->pool.second == 0) || owner == w->pool;
    if (!w->keep) {
      return;
    }
    SegmentInfo s;
    s.device = w->device;
    s.address = f[0];
    s.total_size = f[1];
    s.owner_private_pool_id = owner;
    s.is_expandable = f[4] != 0;
    s.is_large = f[5] != 0;
    s.stream = reinterpret_cast<void*>(f[6]);
    s.requested_size = f[7];
    w->info->segments.push_back(std::move(s));
  };
  auto block = [](void* context, const uint64_t* f) {
    auto* w = static_cast<Walk*>(context);
    if (!w->keep) {
      return;
    }
    SegmentInfo& s = w->info->segments.back();
    BlockInfo b;
    b.size = f[1];
    b.requested_size = f[2];
    b.allocated = f[3] == 0;
    b.active = f[3] <= 1;
    s.allocated_size += b.allocated ? b.size : 0;
    s.active_size += b.active ? b.size : 0;
    if (b.allocated) {
      b.context_when_allocated = (*w->context_of)(reinterpret_cast<void*>(f[0]));
    }
    s.blocks.push_back(std::move(b));
  };
  library.segments_walk(static_cast<int>(device), segment, block, &walk);
}

// Whether the live blocks of `device`'s pool `id` are exactly the pointers `expected`
// (PyTorch's `checkPoolLiveAllocations`).
inline bool pool_lives_exactly(DeviceIndex device, MempoolId_t id,
                               const std::unordered_set<void*>& expected) {
  struct Count {
    const std::unordered_set<void*>* expected;
    bool all_expected = true;
  } count{&expected};
  auto live = [](void* context, uint64_t address) {
    auto* c = static_cast<Count*>(context);
    c->all_expected &= c->expected->count(reinterpret_cast<void*>(address)) == 1;
  };
  int n = library.live_blocks(device, pool_key(id), live, &count);
  return n >= 0 && count.all_expected && static_cast<size_t>(n) == expected.size();
}

}  // namespace cachealloc_torch
