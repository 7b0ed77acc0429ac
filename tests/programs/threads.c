/* Many threads allocate, write their own pattern, check it and free, with random sizes; any
 * overlap between live blocks shows up as a foreign byte. Usage: threads [threads] [iterations] */
#include <pthread.h>
#include "common.h"

static int iterations = 200;

static void *worker(void *arg) {
    unsigned seed = (unsigned)(size_t)arg * 2654435761u + 1;
    unsigned char tag = (unsigned char)(1 + (size_t)arg);
    void *live[8] = {0};
    size_t sizes[8] = {0};
    for (int i = 0; i < iterations; i++) {
        int slot = (int)((seed = seed * 1103515245u + 12345u) >> 16) % 8;
        if (live[slot]) {
            EXPECT(first_wrong_byte(live[slot], tag, sizes[slot]) < 0, "thread %u: a live block was overwritten", tag);
            CHECK(cudaFree(live[slot]));
            live[slot] = NULL;
        } else {
            size_t choices[] = {512, 3000, 65536, 1 << 20, (1 << 20) + 4096, 5 << 20, 12 << 20};
            sizes[slot] = choices[((seed = seed * 1103515245u + 12345u) >> 16) % 7];
            CHECK(cudaMalloc(&live[slot], sizes[slot]));
            CHECK(cudaMemset(live[slot], tag, sizes[slot]));
        }
    }
    for (int s = 0; s < 8; s++) if (live[s]) CHECK(cudaFree(live[s]));
    return NULL;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 8;
    if (argc > 2) iterations = atoi(argv[2]);
    pthread_t t[64];
    for (int i = 0; i < n && i < 64; i++) pthread_create(&t[i], NULL, worker, (void *)(size_t)i);
    for (int i = 0; i < n && i < 64; i++) pthread_join(t[i], NULL);
    printf("OK threads\n");
    return 0;
}
