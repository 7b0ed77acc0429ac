// What PyTorch's memory history needs of its allocator beyond the trace: the compiled regions
// threads are in, and PyTorch's own contexts of events; and PyTorch's GPU trace. Included by
// cachealloc_torch_allocator.cpp, whose allocator keeps one `History` and answers PyTorch's
// `recordHistory`, `pushCompileContext` and `snapshot` with these.
//
// Note [PyTorch's own contexts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The library's trace records every event with the Python stack it walks itself, and the
// snapshot the Python integration serves comes from that trace (cachealloc_memory.py). What
// the walk cannot see, PyTorch's own gatherer (`CapturedTraceback::gather`) can: the frames of
// TorchScript functions, the forward traceback that anomaly mode keeps for the ops of a
// backward pass, C++ frames as PyTorch unwinds them. So when PyTorch's `recordHistory` gives
// this allocator a context recorder, it calls it as the native allocator does — on each
// allocation, and on each free with `context="all"` — and keeps what it returns: with each
// live pointer (`context_when_allocated`) and on its own history of alloc and free entries,
// the last `max_entries` of them. `snapshot()` then answers as the native allocator's does:
// the library's segments and blocks (`cachealloc_segments_walk`), each allocated block with
// its context, and that history; PyTorch turns the contexts into frames
// (`torch::cuda::_memory_snapshot_pickled`, `torch._C._cuda_memorySnapshot`).
//
// Who asks decides how often the recorder runs. A C++ program that calls
// `torch::cuda::_record_memory_history` gets every event gathered, as natively: its snapshot
// has nothing else. The Python integration also passes the program's
// `_record_memory_history` to PyTorch (so that the recorder and the compiled regions reach
// this allocator), but the trace already has the Python frames of every event, and gathering
// them again costs what PyTorch's history costs natively (about a tenth of a small model's
// step: BENCHMARKS.md).
// So for the integration's calls the recorder runs only where it sees more than the trace:
// while the thread runs TorchScript, or while anomaly mode is on. The integration then lays
// PyTorch's frames over the trace's snapshot where it has them (`_with_pytorch_frames`).
#pragma once

#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cachealloc_torch {

// PyTorch's GPU trace (`torch.cuda._gpu_trace`'s memory callbacks, by which CUDA Sanitizer
// follows allocations): told of each allocation and each free, as PyTorch's own allocator
// tells it (PyTorch's test_cuda_trace.py); one load when nothing listens.
inline void trace_gpu_memory(void* ptr, bool allocated) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp)) {
    if (allocated) {
      (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
    } else {
      (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
    }
  }
}

using c10::CachingDeviceAllocator::TraceEntry;
using c10::cuda::CUDACachingAllocator::CreateContextFn;
using c10::cuda::CUDACachingAllocator::RecordContext;

// Note [Compile regions]
// ~~~~~~~~~~~~~~~~~~~~~~
// `_record_memory_history(compile_context=True)` makes PyTorch tell the allocator when a
// thread enters and leaves a region `torch.compile` made ("Torch-Compiled Region: 0/0"); its
// snapshot names on each entry of `device_traces` the region its thread was in ("N/A" outside
// any). Ours come from the library's trace, which knows no regions: the allocator keeps each
// change (the trace's time, the region now innermost) and the Python integration hands them
// to `cachealloc snapshot --compile-context`, which names each entry by the change in force
// at its time. By time, not by thread (PyTorch's stack is the thread's own); the last
// `kKeptChanges` changes are kept, so compiled code called for ever does not grow it.
constexpr const char* kNoCompileRegion = "N/A";

inline std::vector<std::string>& compile_stack() {
  thread_local std::vector<std::string> stack;
  return stack;
}

struct CompileRegions {
  static constexpr size_t kKeptChanges = 1 << 16;

  void change(const std::string& region) {
    static auto now = reinterpret_cast<uint64_t (*)()>(dlsym(RTLD_DEFAULT, "cachealloc_trace_time"));
    if (now == nullptr) {
      return;
    }
    uint64_t t = now();
    std::lock_guard<std::mutex> lock(mutex);
    if (changes.size() >= kKeptChanges) {
      changes.erase(changes.begin(), changes.begin() + kKeptChanges / 2);
    }
    changes.emplace_back(t, region);
  }

  // "TIME\tREGION\n" per change (tabs and newlines in a name become spaces).
  std::string text() {
    std::lock_guard<std::mutex> lock(mutex);
    std::string out;
    for (const auto& [t, region] : changes) {
      out += std::to_string(t);
      out += '\t';
      for (char c : region) {
        out += (c == '\t' || c == '\n') ? ' ' : c;
      }
      out += '\n';
    }
    return out;
  }

  std::mutex mutex;
  std::vector<std::pair<uint64_t, std::string>> changes;
};

inline CompileRegions compile_regions;

class History {
 public:
  // PyTorch's `recordHistory`; `from_integration`: the Python integration made the call.
  void record(bool enabled, CreateContextFn recorder, size_t max_entries, RecordContext when, bool clear,
              const std::vector<std::string>& skip_actions, bool from_integration) {
    std::lock_guard<std::mutex> lock(mutex_);
    recorder_.store(enabled ? recorder : nullptr, std::memory_order_relaxed);
    when_.store(enabled ? when : RecordContext::NEVER, std::memory_order_relaxed);
    max_entries_ = std::max<size_t>(max_entries, 1);
    from_integration_.store(from_integration, std::memory_order_relaxed);
    skipped_.clear();
    for (const auto& name : skip_actions) {
      try {
        skipped_.push_back(c10::CachingDeviceAllocator::parseTraceEntryAction(name));
      } catch (const c10::Error&) {
        // An action this PyTorch's allocator does not record ("user_defined").
      }
    }
    if (!enabled || clear) {
      entries_.clear();
    }
    for (auto& entries : entries_) {
      while (entries.size() > max_entries_) {
        entries.pop_front();
      }
    }
    on_.store(enabled, std::memory_order_release);
  }

  bool enabled() const {
    return on_.load(std::memory_order_acquire);
  }

  // The context of an allocation (`free`: of a free), gathered now, or null. Called outside the
  // allocator's lock: the recorder may take the GIL. Lock-free: the settings are read as they
  // stand (a change races with events in flight, as natively).
  std::shared_ptr<c10::GatheredContext> gather(bool free) {
    if (!enabled()) {
      return nullptr;
    }
    RecordContext when = when_.load(std::memory_order_relaxed);
    CreateContextFn recorder = recorder_.load(std::memory_order_relaxed);
    bool wanted = free ? when == RecordContext::ALL : when != RecordContext::NEVER;
    if (!wanted || recorder == nullptr) {
      return nullptr;
    }
    if (from_integration_.load(std::memory_order_relaxed) && !trace_is_blind()) {
      return nullptr;
    }
    return recorder();
  }

  // An entry of the history. For the integration's calls only events with a context are kept:
  // the trace has the rest.
  void add(TraceEntry::Action action, c10::DeviceIndex device, void* ptr, size_t size, void* stream,
           std::shared_ptr<c10::GatheredContext> context) {
    if (!enabled() || (from_integration_.load(std::memory_order_relaxed) && context == nullptr)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(skipped_.begin(), skipped_.end(), action) != skipped_.end()) {
      return;
    }
    // The entry's context only where the setting keeps it (`context="state"` keeps it on the
    // block alone).
    if (when_.load(std::memory_order_relaxed) == RecordContext::STATE) {
      context = nullptr;
    }
    if (static_cast<size_t>(device) >= entries_.size()) {
      entries_.resize(device + 1);
    }
    auto& entries = entries_[device];
    entries.emplace_back(action, device, reinterpret_cast<size_t>(ptr), size, stream, c10::MempoolId_t{0, 0},
                         c10::getApproximateTime(), std::move(context));
    if (entries.size() > max_entries_) {
      entries.pop_front();
    }
  }

  // The history per device, times in microseconds since the epoch as PyTorch's snapshot has
  // them.
  std::vector<std::vector<TraceEntry>> traces(size_t devices) {
    auto to_ns = clock_.makeConverter();
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::vector<TraceEntry>> out(std::max(devices, entries_.size()));
    for (size_t d = 0; d < entries_.size(); ++d) {
      for (const auto& entry : entries_[d]) {
        TraceEntry copy = entry;
        copy.time_.t_ = to_ns(entry.time_.approx_t_) / 1000;
        out[d].push_back(std::move(copy));
      }
    }
    return out;
  }

  // How many of the history's entries hold a context.
  size_t contexts() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t n = 0;
    for (const auto& entries : entries_) {
      for (const auto& entry : entries) {
        n += entry.context_ != nullptr;
      }
    }
    return n;
  }

 private:
  // Whether PyTorch's gatherer sees what the library's walk of the Python stack cannot: a
  // TorchScript function running on this thread, or anomaly mode's forward traceback.
  static bool trace_is_blind() {
    return torch::autograd::AnomalyMode::is_enabled() || !torch::jit::currentCallstack().empty();
  }

  std::atomic<bool> on_{false};
  std::mutex mutex_;
  // Written under `mutex_`, read without it on the allocation path.
  std::atomic<CreateContextFn> recorder_{nullptr};
  std::atomic<RecordContext> when_{RecordContext::NEVER};
  std::atomic<bool> from_integration_{false};
  // Read and written under `mutex_`.
  size_t max_entries_ = 1;
  std::vector<TraceEntry::Action> skipped_;
  std::vector<std::deque<TraceEntry>> entries_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

}  // namespace cachealloc_torch
