/* Exit without freeing: the process must end normally (exit summary printed, no crash). */
#include "common.h"

int main(void) {
    void *p;
    for (int i = 0; i < 10; i++) CHECK(cudaMalloc(&p, (size_t)(i + 1) << 20));
    printf("OK exit_nofree\n");
    fflush(stdout);
    return 0;
}
