// cachealloc's CUDA allocator for PyTorch: the C++ side of the Python integration.
//
// Built by `cachealloc_torch_build.py` (from `cachealloc_torch_allocator.py`) against the
// headers of the PyTorch it runs with (the interface below changes between releases), loaded
// into the process, and installed in the place of PyTorch's `cudaMallocAsync` backend before
// CUDA is first used. It serves what the backend served (each allocation a `cudaMallocAsync`
// on the current stream, each free a `cudaFreeAsync` on its stream, answered by the library's
// pools) and what the backend refuses: graph pools' checkpoints for CUDA graph trees, PyTorch's
// GPU trace, `MemPool`s over any allocator object, and trace trackers.
//
// Note [Graph trees under the shim]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `torch.compile(mode="reduce-overhead")` records CUDA graphs as a tree whose graphs share one
// private pool. After recording a graph, Inductor takes a checkpoint of the pool
// (`_cuda_getCheckpointState`); before recording a new branch it puts the pool back to that
// checkpoint (`_cuda_setCheckpointPoolState`): the allocator frees every block the pool holds
// and allocates the checkpoint's blocks again, and PyTorch's binding then swaps the deleters of
// the tensors' storages — none for the blocks the allocator freed, the allocator's own for the
// blocks it allocated again — and Inductor asserts that each live storage has the allocator's
// deleter (`_has_Standard_Deleter`). So the allocator must own the deleter of every storage
// and the books of every pointer: what only an allocator installed as PyTorch's CUDA allocator
// can do. The pools and their checkpoints are the library's (`cachealloc_pool_checkpoint`,
// `cachealloc_pool_restore`, Note [Pool checkpoints]); this file keeps, like the backend it
// replaces, each pointer's stream and size, and turns the library's answers into PyTorch's
// types.
//
// `name()` is "native" when the shim chose PyTorch's backend (the program chose none): PyTorch and
// its tests ask `get_allocator_backend()` whether the native allocator's features are there (graph
// pools shared through `pool=`, checkpoints, snapshots, statistics, MemPools, IPC), and under the
// shim they are. A program that asked for `backend:cudaMallocAsync` itself is answered
// "cudaMallocAsync", as it configured. (PyTorch checks, when it parses its settings again, that the
// backend they name is the allocator's name: the integration takes the shim's
// `backend:cudaMallocAsync` out of them.) The rest of those features are served in Python
// (cachealloc_memory.py, cachealloc_history.py), which replaces the `torch._C` entry points that
// would reach this allocator's statistics and IPC methods; the snapshot the program gets comes from
// the library's trace, with the frames of PyTorch's own contexts that this allocator keeps
// (cachealloc_torch_history.h, Note [PyTorch's own contexts]).

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <cuda_runtime_api.h>
#include "cachealloc_torch_history.h"
#include "cachealloc_torch_trackers.h"  // before the library's: its snapshot numbers segments
#include "cachealloc_torch_library.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

// PyTorch's `C10_CUDA_CHECK` on a failure only: on success it still consults its registry of
// device-side assertions, twice a tensor here, where PyTorch's allocator makes no CUDA call for a
// cached block. With the device guards dropped below, a host-bound step fell 2-4 % (BENCHMARKS.md).
#define CACHEALLOC_CUDA_CHECK(EXPR)                  \
  do {                                               \
    const cudaError_t cachealloc_err_ = (EXPR);      \
    if (C10_UNLIKELY(cachealloc_err_ != cudaSuccess)) { \
      C10_CUDA_CHECK(cachealloc_err_);               \
    }                                                \
  } while (0)

namespace cachealloc_torch {

using c10::DataPtr;
using c10::DeleterFnPtr;
using c10::Device;
using c10::cuda::CUDAGuard;

// What the allocator knows of a pointer it handed out.
struct Usage {
  cudaStream_t stream;
  DeviceIndex device;
  size_t size;
  // Streams `record_stream` named that the library could not take (memory that is not in
  // its pools): the free waits for them on the device.
  std::vector<cudaStream_t> other_streams;
  // PyTorch's context of the allocation, while its history asks for one (Note [PyTorch's own
  // contexts]).
  std::shared_ptr<c10::GatheredContext> context = nullptr;
};

// Whether the `recordHistory` call in progress comes from the Python integration (Note
// [PyTorch's own contexts]): set around its call by `cachealloc_torch_history_source`.
std::atomic<bool> history_call_from_integration{false};

void raw_delete_fn(void* ptr);

class Allocator final : public CUDAAllocator {
 public:
  DataPtr allocate(size_t size) override {
    constexpr size_t one_exabyte = 1ull << 60;
    TORCH_CHECK_WITH(OutOfMemoryError, size < one_exabyte,
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    DeviceIndex device = c10::cuda::current_device();
    void* ptr = nullptr;
    if (size != 0) {
      ptr = malloc_on(device, size, c10::cuda::getCurrentCUDAStream(device));
    }
    return {ptr, ptr, &raw_delete_fn, Device(c10::DeviceType::CUDA, device)};
  }

  DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void* raw_alloc(size_t nbytes) override {
    DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device));
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) {
      return nullptr;
    }
    return malloc_on(c10::cuda::current_device(), nbytes, stream);
  }

  void raw_delete(void* ptr) override {
    release(ptr);
  }

  void init(int device_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (devices_.empty()) {
      devices_.resize(device_count, false);
    }
  }

  bool initialized() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return !devices_.empty();
  }

  // The Python integration serves the fraction (`_cuda_setMemoryFraction`,
  // `_cuda_getMemoryFraction`); C++ callers get the library's through the same C API.
  double getMemoryFraction(DeviceIndex device) override {
    using Fraction = double (*)(int);
    auto fraction = reinterpret_cast<Fraction>(dlsym(RTLD_DEFAULT, "cachealloc_memory_fraction"));
    double f = fraction ? fraction(device) : -1.0;
    return f < 0.0 ? 1.0 : f;
  }

  void setMemoryFraction(double fraction, DeviceIndex device) override {
    TORCH_CHECK(0 <= fraction && fraction <= 1, "invalid fraction: ", fraction, ". Please set within [0, 1].");
    using Set = int (*)(int, double);
    auto set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "cachealloc_set_memory_fraction"));
    TORCH_CHECK(set && set(device, fraction) == 0, "cachealloc: the memory fraction could not be set");
  }

  std::vector<StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex) override {
    return {};
  }

  // `caching_allocator_enable` reaches the library through the Python integration.
  void enable(bool) override {}

  bool isEnabled() const override { return true; }

  // As the backend: the library releases its cached segments when the pool is trimmed (a
  // `MemPool`'s went with its last user).
  void emptyCache(MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t device = 0; device < devices_.size() && id == MempoolId_t{0, 0}; ++device) {
      if (devices_[device]) {
        CUDAGuard guard(static_cast<DeviceIndex>(device));
        cudaMemPool_t pool;
        C10_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, static_cast<int>(device)));
        C10_CUDA_CHECK(cudaDeviceSynchronize());
        C10_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
      }
    }
  }

  // A workspace size cuDNN may try: the memory free on the device (the library counts its
  // cached memory in it).
  void cacheInfo(DeviceIndex device, size_t* largest) override {
    CUDAGuard guard(device);
    size_t free_bytes = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    *largest = free_bytes;
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = usage_.find(ptr);
    TORCH_INTERNAL_ASSERT(it != usage_.end(), "cachealloc: pointer not allocated here");
    if (size) {
      *size = it->second.size;
    }
    return ptr;
  }

  void recordStream(const DataPtr& data, c10::cuda::CUDAStream stream) override {
    void* ptr = data.get();
    if (!ptr) {
      return;
    }
    if (library.record_stream(reinterpret_cast<uint64_t>(ptr), reinterpret_cast<size_t>(stream.stream())) == 0) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = usage_.find(ptr);
    if (it != usage_.end() && it->second.stream != stream.stream()) {
      it->second.other_streams.push_back(stream.stream());
    }
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    using c10::CachingDeviceAllocator::StatType;
    c10::CachingDeviceAllocator::DeviceStats stats;
    if (!device_used(device)) {
      return stats;
    }
    CUDAGuard guard(device);
    cudaMemPool_t pool;
    C10_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t reserved = 0, reserved_peak = 0, used = 0, used_peak = 0;
    C10_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    C10_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved_peak));
    C10_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    C10_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used_peak));
    auto all = static_cast<size_t>(StatType::AGGREGATE);
    stats.allocated_bytes[all].current = used;
    stats.allocated_bytes[all].peak = used_peak;
    stats.active_bytes[all].current = used;
    stats.active_bytes[all].peak = used_peak;
    stats.reserved_bytes[all].current = reserved;
    stats.reserved_bytes[all].peak = reserved_peak;
    return stats;
  }

  // The Python integration resets the library's accumulated stats (`_cuda_resetAccumulatedMemoryStats`).
  void resetAccumulatedStats(DeviceIndex) override {}

  void resetPeakStats(DeviceIndex device) override {
    if (!device_used(device)) {
      return;
    }
    CUDAGuard guard(device);
    cudaMemPool_t pool;
    C10_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t zero = 0;
    C10_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
    C10_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
  }

  // The library's segments and blocks with PyTorch's contexts, and the history this allocator
  // kept (Note [PyTorch's own contexts]). The Python integration serves `_cuda_memorySnapshot`
  // from the library's trace, and lays these contexts' frames over it.
  SnapshotInfo snapshot(MempoolId_t pool, bool include_traces) override {
    SnapshotInfo info;
    size_t devices = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      devices = devices_.size();
      auto context_of = [this](void* ptr) -> std::shared_ptr<c10::GatheredContext> {
        auto it = usage_.find(ptr);
        return it == usage_.end() ? nullptr : it->second.context;
      };
      for (size_t d = 0; d < devices; ++d) {
        if (devices_[d]) {
          add_segments(static_cast<DeviceIndex>(d), pool, context_of, info);
        }
      }
    }
    if (include_traces) {
      info.device_traces = history_.traces(devices);
    }
    info.config_metadata.max_split_size = SIZE_MAX;
    info.config_metadata.expandable_segments = std::any_of(
        info.segments.begin(), info.segments.end(), [](const SegmentInfo& s) { return s.is_expandable; });
    return info;
  }

  // A `CUDAGraph` holds its pool from `capture_begin` to `reset` (`use_mem_pool`'s entry points
  // are the Python integration's; Note [The program's graph references]), a `MemPool` from its
  // making to its end (Note [Whose reference releasePool gives back]).
  void beginAllocateToPool(DeviceIndex device, MempoolId_t id, std::function<bool(cudaStream_t)>) override {
    pool_references_.graph_retain(device, id);
  }
  void endAllocateToPool(DeviceIndex, MempoolId_t) override {}
  // A `MemPool`'s `use_on_oom` reaches the library when the pool is made (the Python integration's
  // flags); PyTorch's `MemPool` destructor clears it, which the pool's release makes moot.
  void setUseOnOOM(DeviceIndex, MempoolId_t, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "cachealloc: use_on_oom is given when the MemPool is made (MemPool(use_on_oom=True))");
  }
  void releasePool(DeviceIndex device, MempoolId_t id) override {
    pool_references_.release(device, id);
  }

  int getPoolUseCount(DeviceIndex device, MempoolId_t id) override {
    return library.mem_pool_use_count(device, pool_key(id));
  }

  // Note [MemPools over PyTorch's allocator objects].
  void createOrIncrefPool(DeviceIndex device, MempoolId_t id, std::shared_ptr<CUDAAllocator> allocator) override {
    TORCH_CHECK(pool_references_.mem_pool_retain(device, id, std::move(allocator)) >= 0,
                "cachealloc: MemPool needs the library's pools");
  }

  bool checkPoolLiveAllocations(DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    return pool_lives_exactly(device, id, expected);
  }

  // Sharing is served in Python (`_share_cuda_`, `_new_shared_cuda`: Note [IPC of pooled memory]).
  ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false, "cachealloc: CUDA IPC is served by the Python integration (UntypedStorage._share_cuda_)");
  }

  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false, "cachealloc: CUDA IPC is served by the Python integration (UntypedStorage._new_shared_cuda)");
  }

  // The trace records history always; this is whether PyTorch's `recordHistory` asked for it
  // (Note [PyTorch's own contexts]).
  bool isHistoryEnabled() override {
    return history_.enabled();
  }

  // PyTorch's record-function callbacks, installed by `_record_memory_history(...,
  // compile_context=True)`, name the compiled region a thread enters and leaves (Note
  // [Compile regions]).
  void pushCompileContext(std::string& region) override {
    compile_stack().push_back(region);
    compile_regions.change(region);
  }

  void popCompileContext() override {
    auto& stack = compile_stack();
    if (!stack.empty()) {
      stack.pop_back();
    }
    compile_regions.change(stack.empty() ? std::string(kNoCompileRegion) : stack.back());
  }

  void recordHistory(bool enabled, CreateContextFn recorder, size_t max_entries, RecordContext when, bool clear,
                     const std::vector<std::string>& skip_actions) override {
    history_.record(enabled, recorder, max_entries, when, clear, skip_actions,
                    history_call_from_integration.load(std::memory_order_acquire));
  }

  // How many of PyTorch's contexts the allocator holds: on live pointers and in its history.
  size_t history_contexts() {
    size_t n = history_.contexts();
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [ptr, usage] : usage_) {
      n += usage.context != nullptr;
    }
    return n;
  }

  void attachOutOfMemoryObserver(OutOfMemoryObserver) override {}  // attached in Python
  // Note [Trace trackers under the shim].
  void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) override { trackers.attach(std::move(tracker)); }

  // As the backend: memory of the default pool is made accessible to `dev` (the library gives
  // the device access to its pools).
  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override {
    CUDAGuard guard(dev);
    cudaMemPool_t pool;
    C10_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev_to_access));
    cudaMemAccessDesc desc = {};
    desc.location.type = cudaMemLocationTypeDevice;
    desc.location.id = dev;
    desc.flags = cudaMemAccessFlagsProtReadWrite;
    C10_CUDA_CHECK(cudaMemPoolSetAccess(pool, &desc, 1));
  }

  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

  std::shared_ptr<AllocatorState> getCheckpointState(DeviceIndex device, MempoolId_t id) override {
    void* handle = library.checkpoint(device, pool_key(id));
    TORCH_CHECK(handle, "cachealloc: no checkpoint of graph pool (", id.first, ", ", id.second,
                ") on device ", static_cast<int>(device), ": no such pool, or a block waits for a fence");
    return std::make_shared<PoolState>(handle);
  }

  CheckpointDelta setCheckpointPoolState(DeviceIndex device, std::shared_ptr<AllocatorState> state) override {
    auto pool = std::dynamic_pointer_cast<PoolState>(state);
    TORCH_CHECK(pool, "cachealloc: not a checkpoint of cachealloc's allocator");
    struct Restoring {
      Allocator* self;
      DeviceIndex device;
      CheckpointDelta delta;
    } restoring{this, device, {}};
    auto freed = [](void* context, uint64_t address) {
      auto* r = static_cast<Restoring*>(context);
      void* ptr = reinterpret_cast<void*>(address);
      r->self->usage_.erase(ptr);
      r->delta.ptrs_freed.push_back(ptr);
    };
    auto allocated = [](void* context, uint64_t address, uint64_t size, uint64_t stream) {
      auto* r = static_cast<Restoring*>(context);
      void* ptr = reinterpret_cast<void*>(address);
      r->self->usage_[ptr] = Usage{reinterpret_cast<cudaStream_t>(stream), r->device, size, {}};
      r->delta.dataptrs_allocd.emplace_back(ptr, ptr, &raw_delete_fn, Device(c10::DeviceType::CUDA, r->device));
    };
    std::lock_guard<std::mutex> lock(mutex_);
    int code = library.restore(pool->handle, freed, allocated, &restoring);
    TORCH_CHECK(code == 0, "cachealloc: the graph pool could not be put back to its checkpoint (error ", code,
                "); see the library's message");
    return std::move(restoring.delta);
  }

  std::string name() override {
    return name_;
  }

  // What `name()` answers: set once, at installation.
  void set_name(std::string name) {
    name_ = std::move(name);
  }

  // Free `ptr` on the stream it was allocated on (after the streams the library could not
  // take from `record_stream`).
  void release(void* ptr) {
    Usage usage;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = usage_.find(ptr);
      TORCH_INTERNAL_ASSERT(it != usage_.end(), "cachealloc: free of a pointer not allocated here");
      usage = std::move(it->second);
      usage_.erase(it);
    }
    trace_gpu_memory(ptr, false);  // before the pointer can be handed out again
    // The library frees its own blocks whatever the current device (it finds their pool by
    // address); only memory CUDA frees, or a free that waits for other streams' events, needs
    // the block's device current.
    int code = usage.other_streams.empty() ? library.free_async(ptr, usage.stream) : Library::not_pooled;
    if (code == Library::not_pooled) {
      CUDAGuard guard(usage.device);
      for (cudaStream_t other : usage.other_streams) {
        cudaEvent_t event;
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        C10_CUDA_CHECK(cudaEventRecord(event, other));
        C10_CUDA_CHECK(cudaStreamWaitEvent(usage.stream, event, 0));
        C10_CUDA_CHECK(cudaEventDestroy(event));
      }
      code = cudaFreeAsync(ptr, usage.stream);
    }
    CACHEALLOC_CUDA_CHECK(static_cast<cudaError_t>(code));
    if (history_.enabled()) {
      // The library reuses the block once the stream's work is done; PyTorch's books count
      // the free complete at once, as its `cudaMallocAsync` backend does.
      auto context = history_.gather(true);
      history_.add(TraceEntry::FREE_REQUESTED, usage.device, ptr, usage.size, usage.stream, context);
      history_.add(TraceEntry::FREE_COMPLETED, usage.device, ptr, usage.size, usage.stream, context);
    }
  }

 private:
  // `device` is the current device (every caller passes it): no guard, whose constructor and
  // destructor would each ask the runtime for the device again.
  void* malloc_on(DeviceIndex device, size_t size, cudaStream_t stream) {
    use_device(device);
    auto context = history_.gather(false);
    void* ptr = nullptr;
    cudaError_t err = cudaMallocAsync(&ptr, size, stream);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_bytes = 0, total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                       format_size(size), ". GPU ", static_cast<int>(device), " has a total capacity of ",
                       format_size(total), " of which ", format_size(free_bytes),
                       " is free. (cachealloc: see its out-of-memory report above)");
    }
    CACHEALLOC_CUDA_CHECK(err);
    trace_gpu_memory(ptr, true);
    if (history_.enabled()) {
      history_.add(TraceEntry::ALLOC, device, ptr, size, stream, context);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    usage_[ptr] = Usage{stream, device, size, {}, history_.enabled() ? std::move(context) : nullptr};
    return ptr;
  }

  // As the backend does at a device's first allocation: keep the default pool's memory (the
  // library answers for the default pool). Devices set up already are in `used_`, read without
  // the lock.
  void use_device(DeviceIndex device) {
    bool known = device >= 0 && device < 64;
    if (known && (used_.load(std::memory_order_acquire) >> device & 1)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_cast<size_t>(device) >= devices_.size() || devices_[device]) {
      return;
    }
    cudaMemPool_t pool;
    C10_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t threshold = UINT64_MAX;
    C10_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    devices_[device] = true;
    if (known) {
      used_.fetch_or(uint64_t{1} << device, std::memory_order_release);
    }
  }

  bool device_used(DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<size_t>(device) < devices_.size() && devices_[device];
  }

  static std::string format_size(uint64_t bytes) {
    char text[64];
    if (bytes < (1ull << 20)) {
      std::snprintf(text, sizeof text, "%.2f KiB", bytes / 1024.0);
    } else if (bytes < (1ull << 30)) {
      std::snprintf(text, sizeof text, "%.2f MiB", bytes / 1048576.0);
    } else {
      std::snprintf(text, sizeof text, "%.2f GiB", bytes / 1073741824.0);
    }
    return text;
  }

  std::string name_ = "native";
  History history_;
  PoolReferences pool_references_;
  std::mutex mutex_;
  // Open addressing, as PyTorch's own allocator keeps its blocks: no node allocated and freed
  // per tensor (std::unordered_map's insert was the route's largest single cost on mlp's step:
  // BENCHMARKS.md, twelfth session).
  ska::flat_hash_map<void*, Usage> usage_;
  std::vector<bool> devices_;
  // The devices below 64 that `use_device` set up: a bit each.
  std::atomic<uint64_t> used_{0};
};

// Never destroyed: PyTorch frees tensors during the process's exit, after static destructors
// may have run.
Allocator& instance = *new Allocator;

void raw_delete_fn(void* ptr) {
  instance.release(ptr);
}

}  // namespace cachealloc_torch

// The compiled regions' changes (Note [Compile regions]) as "TIME\tREGION\n" lines: copies
// at most `capacity` bytes into `out` and returns the text's whole length.
extern "C" __attribute__((visibility("default"))) size_t cachealloc_torch_compile_regions(char* out, size_t capacity) {
  std::string text = cachealloc_torch::compile_regions.text();
  if (out != nullptr) {
    std::memcpy(out, text.data(), std::min(capacity, text.size()));
  }
  return text.size();
}

// Install the allocator as PyTorch's CUDA allocator, answering `name` (a NUL-terminated string)
// as the backend's name. Returns 0 when installed; 1 when PyTorch's allocator is already in use
// (too late: the integration keeps the backend); 2 when the preloaded library lacks the C API.
extern "C" __attribute__((visibility("default"))) int cachealloc_torch_allocator_install(const char* name) {
  using namespace c10::cuda::CUDACachingAllocator;
  if (!cachealloc_torch::library.load()) {
    return 2;
  }
  CUDAAllocator* current = allocator.load();
  if (current == &cachealloc_torch::instance) {
    return 0;
  }
  if (current != nullptr && current->initialized()) {
    return 1;
  }
  cachealloc_torch::instance.set_name(name ? name : "native");
  allocator.store(&cachealloc_torch::instance);
  c10::SetAllocator(c10::DeviceType::CUDA, &cachealloc_torch::instance);
  return 0;
}

// The Python integration's `recordHistory` calls are made between `(1)` and `(0)` (Note
// [PyTorch's own contexts]).
extern "C" __attribute__((visibility("default"))) void cachealloc_torch_history_source(int integration) {
  cachealloc_torch::history_call_from_integration.store(integration != 0, std::memory_order_release);
}

// How many of PyTorch's contexts the allocator holds (0: its snapshot has no frames to add).
extern "C" __attribute__((visibility("default"))) size_t cachealloc_torch_history_contexts() {
  return cachealloc_torch::instance.history_contexts();
}
