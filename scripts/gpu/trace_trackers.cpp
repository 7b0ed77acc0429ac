// A trace tracker as NCCL attaches one (`attachAllocatorTraceTracker`), for
// scripts/gpu/trace_trackers.py: it keeps every entry's action, device, address, size and pool,
// which the script reads through ctypes. Built by the script against the PyTorch in use.
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace {
std::mutex mutex;
std::vector<int64_t> kept;  // 6 a entry: action, device, address, size, pool.first, pool.second
}  // namespace

extern "C" __attribute__((visibility("default"))) void tracker_attach() {
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::CachingDeviceAllocator::TraceEntry& te) {
        std::lock_guard<std::mutex> lock(mutex);
        kept.insert(kept.end(), {static_cast<int64_t>(te.action_), static_cast<int64_t>(te.device_),
                                 static_cast<int64_t>(te.addr_), static_cast<int64_t>(te.size_),
                                 static_cast<int64_t>(te.mempool_.first), static_cast<int64_t>(te.mempool_.second)});
      });
}

// Copy up to `capacity` int64s of the entries kept so far into `out`; returns how many there are.
extern "C" __attribute__((visibility("default"))) int64_t tracker_entries(int64_t* out, int64_t capacity) {
  std::lock_guard<std::mutex> lock(mutex);
  for (int64_t i = 0; i < capacity && i < static_cast<int64_t>(kept.size()); ++i) {
    out[i] = kept[i];
  }
  return static_cast<int64_t>(kept.size());
}
