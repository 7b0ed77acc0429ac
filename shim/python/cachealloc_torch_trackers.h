// PyTorch's allocator trace trackers (`attachAllocatorTraceTracker`), served from the library's
// segment trackers. Included by cachealloc_torch_allocator.cpp, whose allocator keeps one
// `Trackers`.
//
// Note [Trace trackers under the shim]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch calls each attached tracker with every entry its allocator records; those who attach
// one act on segments: `ProcessGroupNCCL` registers each new segment with its communicators and
// deregisters it before it is freed (`register_mem_pool`, the NCCL user buffers and symmetric
// memory of Megatron and others; every segment with
// `TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`), torchcomms its RDMA registrations. The
// segments are the library's, so this allocator attaches one function to the library when it is
// loaded (`cachealloc_attach_segment_tracker`), which the library calls with each segment
// allocated, each one leaving the pools before it is freed, and each mapping of an expandable
// segment made and unmapped, with the pool's id (the library's Note [Segment trackers]); it turns
// each into PyTorch's `TraceEntry` and calls every tracker with it. The block-level entries
// (allocations, frees) are not sent: the trace holds them, and no tracker we know of reads them.
//
// Two things differ from PyTorch's allocator, both for NCCL's sake. The trackers run outside
// the library's lock (PyTorch calls them with its lock held): under the shim a tracker's own
// library allocates from the same pools (NCCL's `cudaMalloc`s reach them; natively they bypass
// PyTorch's allocator), and would otherwise wait for the lock its thread holds. And a segment
// made by an allocation inside a tracker is not told (nor its release), which would call the
// tracker again inside itself. A tracker that throws is reported on stderr and the others are
// still called: an exception must not cross the library's frames.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace cachealloc_torch {

// Segments are also numbered in the order they were made, for the snapshot's
// `registration_counter`: `register_mem_pool` registers a pool's segments in that order, the same
// on every rank (a symmetric window's registration is collective), and refuses a snapshot
// without it. So the function is attached when this library is loaded, before any tracker.
class Trackers {
 public:
  Trackers() {
    using Attach = int (*)(void (*)(int, int, uint64_t, uint64_t, uint64_t));
    auto attach = reinterpret_cast<Attach>(dlsym(RTLD_DEFAULT, "cachealloc_attach_segment_tracker"));
    attached_ = attach != nullptr && attach(&Trackers::told) == 0;
  }

  // PyTorch's `attachAllocatorTraceTracker`.
  void attach(c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) {
    TORCH_CHECK(attached_, "cachealloc: the preloaded library takes no segment trackers");
    std::lock_guard<std::mutex> lock(mutex_);
    trackers_.push_back(std::move(tracker));
  }

  // The place of the segment at `address` in the order segments were made (one seen first here
  // takes the next place).
  int64_t registration_counter(int device, uint64_t address) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [at, made] = order_.try_emplace({device, address}, next_);
    next_ += made;
    return at->second;
  }

  // The library's call: `action` 1-4 (segment allocated, freed, mapped, unmapped), `pool` packed
  // as `pool_key` packs PyTorch's pool id (0: the device's own pool).
  static void told(int action, int device, uint64_t address, uint64_t size, uint64_t pool);

 private:
  std::mutex mutex_;
  std::vector<c10::cuda::CUDACachingAllocator::AllocatorTraceTracker> trackers_;
  std::map<std::pair<int, uint64_t>, int64_t> order_;
  int64_t next_ = 0;
  bool attached_ = false;
};

inline Trackers trackers;

inline void Trackers::told(int action, int device, uint64_t address, uint64_t size, uint64_t pool) {
  using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
  static constexpr Action kActions[] = {Action::SEGMENT_ALLOC, Action::SEGMENT_FREE, Action::SEGMENT_MAP,
                                        Action::SEGMENT_UNMAP};
  if (action < 1 || action > 4) {
    return;
  }
  std::vector<c10::cuda::CUDACachingAllocator::AllocatorTraceTracker> all;
  {
    std::lock_guard<std::mutex> lock(trackers.mutex_);
    if (action == 1 || action == 3) {
      trackers.order_[{device, address}] = trackers.next_++;
    } else {
      trackers.order_.erase({device, address});
    }
    all = trackers.trackers_;
  }
  c10::MempoolId_t id{static_cast<c10::CaptureId_t>(pool >> 32), static_cast<c10::CaptureId_t>(pool & 0xFFFFFFFFull)};
  c10::CachingDeviceAllocator::TraceEntry entry(kActions[action - 1], static_cast<c10::DeviceIndex>(device),
                                                static_cast<size_t>(address), static_cast<size_t>(size), nullptr,
                                                id, c10::getApproximateTime());
  for (const auto& tracker : all) {
    try {
      tracker(entry);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cachealloc: a segment tracker failed at %#llx (%llu bytes): %s\n",
                   static_cast<unsigned long long>(address), static_cast<unsigned long long>(size), e.what());
    } catch (...) {
      std::fprintf(stderr, "cachealloc: a segment tracker failed at %#llx\n", static_cast<unsigned long long>(address));
    }
  }
}

}  // namespace cachealloc_torch
