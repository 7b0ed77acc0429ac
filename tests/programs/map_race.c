/* A free of a block carved from memory that another thread's allocation has mapped and not yet
 * returned from (found on two H200s by `peer_access race`: cudaFree of a live block answered
 * "invalid argument", since the pools' address span was widened only when the mapping
 * allocation returned). Staged with expandable_segments:True over fakecuda whose calls that
 * make memory take FAKECUDA_SLOW_US (10 ms here), so that the steps happen in this order:
 *
 *  1. the main thread maps 10 MiB and frees it (F: the free end of the mapped memory);
 *  2. thread A asks for 30 MiB: it maps 20 MiB after F, slowly, to use F as well;
 *  3. meanwhile the main thread takes F (10 MiB): A's new memory finds F gone, joins the free
 *     blocks, and A maps again;
 *  4. meanwhile the main thread allocates 4 MiB, served from A's new memory, and frees it: the
 *     free must find its block.
 *
 * fakecuda only (the timing is fakecuda's). Prints "OK map_race". */
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>
#include "common.h"

static void *thread_a(void *out) {
    void *p;
    CHECK(cudaMalloc(&p, 30 << 20));
    *(void **)out = p;
    return NULL;
}

int main(void) {
    const char *slow = getenv("FAKECUDA_SLOW_US");
    long us = slow ? atol(slow) : 0;
    EXPECT(us >= 5000, "needs FAKECUDA_SLOW_US of at least 5000 (fakecuda's slow memory calls)");
    CHECK(cudaFree(0));
    void *f0;
    CHECK(cudaMalloc(&f0, 10 << 20));
    CHECK(cudaFree(f0));

    void *a = NULL;
    pthread_t t;
    pthread_create(&t, NULL, thread_a, &a);
    usleep((useconds_t)(us * 2)); /* A's first map is under way (about 7 slow calls) */
    void *f;
    CHECK(cudaMalloc(&f, 10 << 20));
    EXPECT(f == f0, "step 3 not reached: the 10 MiB came from %p, not the free end %p", f, f0);
    usleep((useconds_t)(us * 7)); /* A's first map is done, its second under way */
    void *q;
    CHECK(cudaMalloc(&q, 4 << 20));
    EXPECT((char *)q >= (char *)f0 + (10 << 20),
           "step 4 not reached: the 4 MiB came from %p, not from the memory A mapped first", q);
    cudaError_t e = cudaFree(q);
    EXPECT(e == cudaSuccess, "cudaFree(%p) of a block of memory another thread is still mapping returned %d (%s)",
           q, (int)e, cudaGetErrorString(e));
    pthread_join(t, NULL);
    EXPECT(a != NULL, "thread A got no memory");
    CHECK(cudaFree(a));
    CHECK(cudaFree(f));
    printf("OK map_race\n");
    return 0;
}
