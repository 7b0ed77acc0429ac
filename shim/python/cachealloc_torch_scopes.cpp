// cachealloc's backward scopes in C++: the part of the category hooks
// (cachealloc_categories.py) that names, in backward, the module whose forward made an
// autograd node, without a Python call on either side; and the gradients' tags after each
// backward, one call for a model's parameters (Note [Gradients' tags in C++]).
//
// Built and loaded by `cachealloc_backward_scopes.py` against the headers of the PyTorch in
// use (`cachealloc_torch_build.py`); without it the hooks do the same in Python.
//
// Note [Backward scopes in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When a decoder layer's forward returns, the category hooks *claim* its output's autograd
// node: when backward reaches that node, the thread running it (autograd's) is in that layer
// until another claimed node says otherwise, so the gradients' and temporaries' blocks it
// allocates are the layer's. In Python a claim is `output.grad_fn.register_prehook(hook)`: a
// Python object for the node, a hooks dict, a `RemovableHandle`, and in backward a Python call
// on the autograd thread with every gradient wrapped — about 26 µs a claim and 15 µs a call on
// the development VM, a third of the hooks' cost on a Llama step (BENCHMARKS.md). Here a claim
// is a C++ `FunctionPreHook` added to the node itself (`cachealloc_torch_claim`, one ctypes
// call with the tensor's `_cdata`: no Python object, and no Python headers to build against),
// and the hook is a store into the autograd thread's scope slot (the library's
// `cachealloc_scope_slot`, which the allocation path reads). A node already carrying one of
// these hooks is not claimed again (an inner module claimed it first: the finer name wins).
// The slots the hooks wrote during a backward are remembered, once per thread and backward,
// and cleared when `backward()` returns (`cachealloc_torch_backward_end`): autograd's threads
// are idle then, and their next allocations belong to the next backward's modules.
//
// Nothing here holds a Python object: the node keeps its hook as long as the graph lives, and
// the hook holds only the scope's number. Under compiled autograd the hook is left out of the
// compiled graph (`compiled_args` registers nothing): backward then runs in the scope of its
// caller, as with `categories:off`.

// Note [Gradients' tags in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// After each `backward()` the hooks tag the `.grad`s of the model's parameters as gradients
// (with `zero_grad(set_to_none=True)` they are new blocks each step). In Python that is, per
// parameter, a weak reference's call, `.grad` and `data_ptr()`, then an `array` and a ctypes
// call: about 5 µs for the 48 parameters of an 8-block MLP in a hot loop and several times
// that inside a training step, the largest single part of the hooks' fixed cost a step. Here
// the Python side passes the parameters' `_cdata` (kept in an `array` while they live: the
// hooks' weak references say when one dies), one call per device, and this reads each one's
// `grad()` and its data pointer and tags them through the library's `cachealloc_tag`.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using torch::autograd::FunctionPreHook;
using torch::autograd::variable_list;

// The preloaded library's `cachealloc_scope_slot`: the calling thread's scope slot.
using SlotFn = uint32_t* (*)();
SlotFn scope_slot = nullptr;
// The preloaded library's `cachealloc_tag`: blocks holding the addresses are of a category.
using TagFn = int (*)(int device, unsigned category, const uint64_t* addresses, size_t count);
TagFn tag = nullptr;

// The slots backward's hooks wrote since the last `cachealloc_torch_backward_end`, each once.
std::mutex written_lock;
std::vector<uint32_t*> written;
// Bumped by each `cachealloc_torch_backward_end`: a thread whose last remembered generation
// is older remembers its slot again at its next hook.
std::atomic<uint64_t> generation{1};

struct ThreadSlot {
  uint32_t* slot = nullptr;
  uint64_t remembered = 0;  // the generation in which `slot` was added to `written`
};
thread_local ThreadSlot thread_slot;

void store(uint32_t* slot, uint32_t value) {
  // The library reads the slot as an atomic word (its own thread, and the thread that clears
  // it after backward).
  __atomic_store_n(slot, value, __ATOMIC_RELAXED);
}

// The pre-hook of a claimed node: the thread running the node is in module `scope`.
struct BackwardScope final : FunctionPreHook {
  explicit BackwardScope(uint32_t scope) : scope(scope) {}

  variable_list operator()(const variable_list& grads) override {
    ThreadSlot& t = thread_slot;
    if (t.slot == nullptr) {
      t.slot = scope_slot();
      if (t.slot == nullptr) {
        return grads;
      }
    }
    uint64_t now = generation.load(std::memory_order_relaxed);
    if (t.remembered != now) {
      std::lock_guard<std::mutex> guard(written_lock);
      written.push_back(t.slot);
      t.remembered = now;
    }
    store(t.slot, scope);
    return grads;
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}

  const uint32_t scope;
};

}  // namespace

extern "C" {

// Finds the preloaded library's scope slot and tag call; 0, or -1 when the library is not
// there.
int cachealloc_torch_scopes_load() {
  scope_slot = reinterpret_cast<SlotFn>(dlsym(RTLD_DEFAULT, "cachealloc_scope_slot"));
  tag = reinterpret_cast<TagFn>(dlsym(RTLD_DEFAULT, "cachealloc_tag"));
  return scope_slot != nullptr && tag != nullptr ? 0 : -1;
}

// Claim the autograd node of the tensor whose implementation is `impl` (a Python tensor's
// `_cdata`) for module `scope`: when backward reaches the node, the thread running it is in
// that module. Returns 1 when claimed, 0 when the tensor has no node or the node is claimed
// already, -1 before `cachealloc_torch_scopes_load`, -2 when PyTorch raised (its error is
// dropped: the hooks never change the program's behaviour). The caller holds the tensor (and
// the GIL: ctypes' PyDLL; nothing here touches Python).
int cachealloc_torch_claim(void* impl, unsigned scope) {
  if (scope_slot == nullptr || impl == nullptr) {
    return -1;
  }
  try {
    at::Tensor tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(
        static_cast<c10::TensorImpl*>(impl)));
    const std::shared_ptr<torch::autograd::Node>& node = tensor.grad_fn();
    if (!node) {
      return 0;
    }
    for (const auto& hook : node->pre_hooks()) {
      if (dynamic_cast<const BackwardScope*>(hook.get()) != nullptr) {
        return 0;
      }
    }
    node->add_pre_hook(std::make_unique<BackwardScope>(scope));
    return 1;
  } catch (...) {
    return -2;
  }
}

// Tag as `category` the blocks of device `device` that hold the gradients of the `count`
// tensors whose implementations are at `impls` (Python tensors' `_cdata`, parameters of that
// device, which the caller keeps alive and holds the GIL for): Note [Gradients' tags in C++].
// Returns how many gradients were tagged, -1 before `cachealloc_torch_scopes_load`, -2 when
// PyTorch raised (nothing is tagged then).
int64_t cachealloc_torch_tag_gradients(int device, void* const* impls, size_t count,
                                       unsigned category) {
  if (tag == nullptr) {
    return -1;
  }
  thread_local std::vector<uint64_t> addresses;  // reused: no allocation once warm
  addresses.clear();
  try {
    for (size_t i = 0; i < count; ++i) {
      auto* impl = static_cast<c10::TensorImpl*>(impls[i]);
      if (impl == nullptr) {
        continue;
      }
      const at::Tensor& grad = impl->grad();
      if (grad.defined() && grad.layout() == c10::kStrided && grad.has_storage()) {
        addresses.push_back(reinterpret_cast<uint64_t>(grad.data_ptr()));
      }
    }
  } catch (...) {
    return -2;
  }
  if (!addresses.empty()) {
    tag(device, category, addresses.data(), addresses.size());
  }
  return static_cast<int64_t>(addresses.size());
}

// `backward()` returned: the slots its hooks wrote go back to no scope. Returns how many.
size_t cachealloc_torch_backward_end() {
  std::lock_guard<std::mutex> guard(written_lock);
  size_t n = written.size();
  for (uint32_t* slot : written) {
    store(slot, 0);
  }
  written.clear();
  generation.fetch_add(1, std::memory_order_relaxed);
  return n;
}

}  // extern "C"
