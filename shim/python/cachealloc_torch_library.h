// The preloaded library as cachealloc's allocator for PyTorch sees it: the functions of its C
// API it calls (cachealloc's `ffi/c_api`), found when the allocator is installed, and what it
// builds from their answers (pool checkpoints, the segments of a snapshot). Included by
// cachealloc_torch_allocator.cpp, after cachealloc_torch_trackers.h.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <dlfcn.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
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
  using ContextAlloc = void* (*)(void*, ssize_t, int, cudaStream_t);
  using ContextFree = void (*)(void*, void*, ssize_t, int, cudaStream_t);
  int (*mem_pool_retain_with)(int, uint64_t, unsigned, ContextAlloc, ContextFree, void*) = nullptr;
  int (*mem_pool_use_count)(int, uint64_t) = nullptr;
  int (*mem_pool_release)(int, uint64_t) = nullptr;
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
        find(mem_pool_retain_with, "cachealloc_mem_pool_retain_with_context") &&
        find(mem_pool_use_count, "cachealloc_mem_pool_use_count") &&
        find(mem_pool_release, "cachealloc_mem_pool_release") &&
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

// Note [MemPools over PyTorch's allocator objects]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A `MemPool(allocator)` takes its segments from `allocator`. The Python integration reads a
// `CUDAPluggableAllocator`'s two functions itself; any other allocator object (the NCCL process
// group's `backend.mem_allocator`, made in C++ over `ncclMemAlloc`) reaches this allocator only
// through PyTorch's own `_MemPool`, whose constructor calls `createOrIncrefPool` with it. The
// pool is then the library's, its segments taken from and given back to the object through
// the two functions below, the object kept for the rest of the process (the library may give a
// segment back until the pool's last one goes, long after the program let go of its pool).
// The pool's flags (`use_on_oom`, `no_split`) come from the integration just before
// (`cachealloc_torch_next_pool_flags`): PyTorch's constructor has no way to pass them here.
struct ForeignPool {
  std::shared_ptr<CUDAAllocator> allocator;
};

inline void* foreign_alloc(void* context, ssize_t size, int device, cudaStream_t stream) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<DeviceIndex>(device));
    return static_cast<ForeignPool*>(context)->allocator->raw_alloc_with_stream(static_cast<size_t>(size), stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cachealloc: a MemPool's allocator failed to allocate %zd bytes: %s\n", size, e.what());
    return nullptr;
  }
}

inline void foreign_free(void* context, void* ptr, ssize_t, int device, cudaStream_t) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<DeviceIndex>(device));
    static_cast<ForeignPool*>(context)->allocator->raw_delete(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cachealloc: a MemPool's allocator failed to free %p: %s\n", ptr, e.what());
  }
}

// The flags of the next pool this thread makes (see the Note).
inline thread_local unsigned next_pool_flags = 0;

}  // namespace cachealloc_torch

// The flags of the next MemPool the calling thread makes (see the Note). Defined here, not inline:
// this header is part of one translation unit, and the function must be in the library.
extern "C" __attribute__((visibility("default"))) void cachealloc_torch_next_pool_flags(unsigned flags) {
  cachealloc_torch::next_pool_flags = flags;
}

namespace cachealloc_torch {

// A reference to the library's private pool `id` of `device`, made if needed: over `allocator`
// when there is one (see the Note). Returns the use count, or < 0.
inline int retain_pool(DeviceIndex device, MempoolId_t id, std::shared_ptr<CUDAAllocator> allocator) {
  unsigned flags = next_pool_flags;
  next_pool_flags = 0;
  if (!allocator) {
    return library.mem_pool_retain(device, pool_key(id), flags, nullptr, nullptr);
  }
  auto* kept = new ForeignPool{std::move(allocator)};  // for the rest of the process
  return library.mem_pool_retain_with(device, pool_key(id), flags, &foreign_alloc, &foreign_free, kept);
}

// Note [Whose reference releasePool gives back]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch calls `releasePool` for two holders of a private pool: a `CUDAGraph` at its reset (it
// took its reference with `beginAllocateToPool`) and a `MemPool` in its destructor (it took its
// reference with `createOrIncrefPool`). The library counts the two kinds apart (Note [Private
// pools] in its `process`), so each release goes back as the kind this pool still holds: a
// graph's while a graph holds the pool, else its `MemPool`'s. A `MemPool` deleted while a graph
// captured into it lives swaps the two for a while; the pool's users count the same.
class PoolReferences {
 public:
  void graph_retain(DeviceIndex device, MempoolId_t id) {
    library.graph_pool_retain(device, pool_key(id));
    std::lock_guard<std::mutex> lock(mutex_);
    ++graphs_[key(device, id)];
  }

  int mem_pool_retain(DeviceIndex device, MempoolId_t id, std::shared_ptr<CUDAAllocator> allocator) {
    int count = retain_pool(device, id, std::move(allocator));
    if (count >= 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      ++mem_pools_[key(device, id)];
    }
    return count;
  }

  void release(DeviceIndex device, MempoolId_t id) {
    bool mem_pools = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto k = key(device, id);
      auto graph = graphs_.find(k);
      auto mem_pool = mem_pools_.find(k);
      if (graph != graphs_.end() && graph->second > 0) {
        --graph->second;
      } else if (mem_pool != mem_pools_.end() && mem_pool->second > 0) {
        --mem_pool->second;
        mem_pools = true;
      }
    }
    if (mem_pools) {
      library.mem_pool_release(device, pool_key(id));
    } else {
      library.graph_pool_release(device, pool_key(id));
    }
  }

 private:
  static std::pair<int, uint64_t> key(DeviceIndex device, MempoolId_t id) {
    return {static_cast<int>(device), pool_key(id)};
  }
  std::mutex mutex_;
  std::map<std::pair<int, uint64_t>, int> graphs_;
  std::map<std::pair<int, uint64_t>, int> mem_pools_;
};

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
    s.registration_counter = trackers.registration_counter(static_cast<int>(w->device), f[0]);
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
