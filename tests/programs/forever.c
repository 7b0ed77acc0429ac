/* Allocate and free until killed (for the kill -9 test): prints "started" once the first
 * thousand pairs are done. */
#include <unistd.h>
#include "common.h"

int main(void) {
    for (unsigned long i = 0;; i++) {
        void *p;
        CHECK(cudaMalloc(&p, 4096 + (i % 7) * 512));
        CHECK(cudaFree(p));
        if (i == 1000) { printf("started\n"); fflush(stdout); }
        if (i % 100 == 0) usleep(100);
    }
}
