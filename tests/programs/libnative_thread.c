/* A helper library for Python test programs: allocate on a thread that Python never saw, as
 * PyTorch's autograd engine does (its device threads have no Python frames). */
#include <pthread.h>

#include "common.h"

static void *alloc_and_free(void *arg) {
    size_t bytes = *(size_t *)arg;
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return (void *)1;
    return cudaFree(p) == cudaSuccess ? NULL : (void *)1;
}

/* Allocate and free `bytes` on a new native thread; returns 0 on success. */
int alloc_on_native_thread(size_t bytes) {
    pthread_t t;
    void *result = (void *)1;
    if (pthread_create(&t, NULL, alloc_and_free, &bytes) != 0) return 1;
    pthread_join(t, &result);
    return result != NULL;
}
