/* What the Python integration tells the library about a program (module scopes, phases, what
 * blocks hold), through the C API its hooks call, around allocations of two threads:
 *  - a scope name's id is the same for the same name; a null name gets 0;
 *  - an unknown scope id, phase or category, a negative device or null addresses are refused
 *    with cudaErrorInvalidValue (1) and write nothing;
 *  - the calls before the first CUDA call (no trace yet) are accepted and do nothing;
 *  - a scope written to the thread's slot counts as one set by a call;
 *  - a phase change ends every thread's scope in the trace: a scope set before it is said again
 *    at the thread's next allocation.
 * The trace's records are checked by tests/tests/trace.rs. Runs under the shim only (it needs
 * the C API). Prints the blocks' addresses as "block NAME ADDRESS". */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>

#include "common.h"

static unsigned (*scope_define)(const char *);
static int (*scope_set)(unsigned);
static int (*phase_set)(unsigned, uint64_t);
static int (*tag)(int, unsigned, const uint64_t *, size_t);
static unsigned *(*scope_slot)(void);

static void *api(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    EXPECT(f != NULL, "the library does not export %s", name);
    return f;
}

static unsigned inner;

/* An autograd-like thread: its own scope, in the backward phase the main thread set. */
static void *backward_thread(void *out) {
    EXPECT(scope_set(inner) == 0, "scope_set on a second thread");
    CHECK(cudaMalloc((void **)out, 8192));
    return NULL;
}

int main(void) {
    scope_define = api("cachealloc_scope_define");
    scope_set = api("cachealloc_scope_set");
    phase_set = api("cachealloc_phase_set");
    tag = api("cachealloc_tag");
    scope_slot = api("cachealloc_scope_slot");

    unsigned outer = scope_define("Net");
    inner = scope_define("Net.layers.0");
    EXPECT(outer >= 1 && inner >= 1 && outer != inner, "ids %u %u", outer, inner);
    EXPECT(scope_define("Net.layers.0") == inner, "the same name, the same id");
    EXPECT(scope_define(NULL) == 0, "a null name");
    /* Before the first CUDA call: no trace yet, accepted, nothing written. */
    EXPECT(phase_set(1, 0) == 0 && scope_set(outer) == 0, "facts before the trace");
    EXPECT(phase_set(0, 0) == 0 && scope_set(0) == 0, "facts before the trace");

    void *weights, *input, *hidden, *temporary, *grad;
    CHECK(cudaMalloc(&weights, 1 << 20));
    CHECK(cudaMalloc(&input, 4096));
    EXPECT(phase_set(1, 0) == 0, "forward");
    EXPECT(scope_set(outer) == 0, "scope outer");
    CHECK(cudaMalloc(&hidden, 4096));
    /* The thread's slot, written directly (what the Python integration's hooks do). */
    unsigned *slot = scope_slot();
    EXPECT(slot != NULL && *slot == outer, "the slot holds the scope set");
    *slot = inner;
    CHECK(cudaMalloc(&temporary, 4096));
    CHECK(cudaFree(temporary));
    EXPECT(scope_set(outer) == 0 && scope_set(0) == 0, "scopes back out");
    uint64_t params[1] = {(uint64_t)(uintptr_t)weights + 512};
    EXPECT(tag(0, 1, params, 1) == 0, "tag the weights (inside the block)");
    uint64_t inputs[1] = {(uint64_t)(uintptr_t)input};
    EXPECT(tag(0, 4, inputs, 1) == 0, "tag the input");
    /* Refusals. */
    EXPECT(scope_set(999) == 1, "an unknown scope");
    EXPECT(phase_set(4, 0) == 1, "an unknown phase");
    EXPECT(tag(0, 6, params, 1) == 1 && tag(0, 0, params, 1) == 1, "an unknown category");
    EXPECT(tag(-1, 1, params, 1) == 1, "a negative device");
    EXPECT(tag(0, 1, NULL, 1) == 1, "null addresses");
    EXPECT(tag(0, 1, NULL, 0) == 0, "no addresses");

    EXPECT(phase_set(2, 0) == 0, "backward");
    pthread_t t;
    EXPECT(pthread_create(&t, NULL, backward_thread, &grad) == 0, "thread");
    pthread_join(t, NULL);
    uint64_t grads[1] = {(uint64_t)(uintptr_t)grad};
    EXPECT(tag(0, 3, grads, 1) == 0, "tag the gradient");
    CHECK(cudaFree(hidden));
    EXPECT(phase_set(0, 1) == 0, "the step ends");
    void *before_phase, *after_phase;
    EXPECT(scope_set(outer) == 0, "scope outer, between phases");
    CHECK(cudaMalloc(&before_phase, 4096));
    EXPECT(phase_set(3, 1) == 0, "the optimizer");
    CHECK(cudaMalloc(&after_phase, 4096));
    EXPECT(scope_set(0) == 0, "scope none");
    printf("block weights %llu\nblock input %llu\nblock grad %llu\nblock after_phase %llu\n",
           (unsigned long long)(uintptr_t)weights, (unsigned long long)(uintptr_t)input,
           (unsigned long long)(uintptr_t)grad, (unsigned long long)(uintptr_t)after_phase);
    CHECK(cudaFree(after_phase));
    CHECK(cudaFree(before_phase));
    CHECK(cudaFree(grad));
    CHECK(cudaFree(input));
    CHECK(cudaFree(weights));
    printf("OK program_context\n");
    return 0;
}
