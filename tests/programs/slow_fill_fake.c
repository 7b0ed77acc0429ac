/* slow_fill over fakecuda: a host function on the stream's worker (fakecuda's device memory is
 * host memory). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "common.h"

struct fill { void *ptr; unsigned char value; size_t bytes; int ms; };

static void run_fill(void *arg) {
    struct fill *f = (struct fill *)arg;
    usleep((useconds_t)f->ms * 1000);
    memset(f->ptr, f->value, f->bytes);
    free(f);
}

void slow_fill(void *ptr, unsigned char value, size_t bytes, int ms, cudaStream_t stream) {
    struct fill *f = (struct fill *)malloc(sizeof *f);
    f->ptr = ptr; f->value = value; f->bytes = bytes; f->ms = ms;
    CHECK(cudaLaunchHostFunc(stream, run_fill, f));
}
