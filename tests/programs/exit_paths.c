/* The ways a process ends, and signals, while it allocates. Usage: exit_paths MODE
 *  thread   — a second thread calls exit() while the main thread allocates (after its first
 *             1000 pairs);
 *  _exit    — _exit() with blocks live: no atexit handlers run;
 *  signals  — a 100 µs interval timer interrupts 200 000 alloc/free pairs (its handler counts);
 * Prints "OK exit_paths" before ending (for thread and _exit, just before the exit). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>
#include <unistd.h>
#include "common.h"

static volatile sig_atomic_t ticks;
static void on_tick(int sig) { (void)sig; ticks++; }

static volatile unsigned long pairs; /* alloc/free pairs the main thread completed */

static void *exiter(void *arg) {
    (void)arg;
    /* Exit while the main thread allocates: once it has (CUDA's initialization takes longer
     * than a fixed sleep on a real GPU: an exit during it found no shim started yet). */
    while (__atomic_load_n(&pairs, __ATOMIC_RELAXED) < 1000) usleep(1000);
    printf("OK exit_paths\n");
    fflush(stdout);
    exit(0);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "thread";
    if (strcmp(mode, "thread") == 0) {
        pthread_t t;
        pthread_create(&t, NULL, exiter, NULL);
        for (unsigned long i = 0;; i++) {
            void *p;
            CHECK(cudaMalloc(&p, 512 + (i % 9) * 4096));
            CHECK(cudaFree(p));
            __atomic_store_n(&pairs, i + 1, __ATOMIC_RELAXED);
        }
    }
    if (strcmp(mode, "_exit") == 0) {
        void *p;
        for (int i = 0; i < 1000; i++) {
            CHECK(cudaMalloc(&p, 4096));
            if (i % 2) CHECK(cudaFree(p));
        }
        printf("OK exit_paths\n");
        fflush(stdout);
        _exit(0);
    }
    if (strcmp(mode, "signals") == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_tick;  /* no SA_RESTART: interrupted system calls return EINTR */
        sigaction(SIGALRM, &sa, NULL);
        struct itimerval every = {{0, 100}, {0, 100}};
        setitimer(ITIMER_REAL, &every, NULL);
        cudaStream_t s;
        CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        for (int i = 0; i < 200000; i++) {
            void *p;
            if (i % 3 == 0) {
                CHECK(cudaMallocAsync(&p, 1000 + (size_t)(i % 17) * 512, s));
                CHECK(cudaFreeAsync(p, s));
            } else {
                CHECK(cudaMalloc(&p, 1000 + (size_t)(i % 17) * 512));
                CHECK(cudaFree(p));
            }
        }
        struct itimerval off = {{0, 0}, {0, 0}};
        setitimer(ITIMER_REAL, &off, NULL);
        CHECK(cudaStreamDestroy(s));
        EXPECT(ticks > 0, "the timer never fired");
        printf("ticks %d\n", (int)ticks);
        printf("OK exit_paths\n");
        return 0;
    }
    FAIL("unknown mode %s", mode);
}
