/* The threads' stages (recorder Note [Staged sends]) through the whole library. Two threads
 * take turns allocating and freeing blocks of one size, so the pool hands an address from one
 * thread to the other: the trace must keep every free before the next allocation of its
 * address, though each thread's records reach the recorder 16 at a time. The stages are
 * paused by default: the program turns them on (`cachealloc_stages_pause(0)`), pauses them in
 * the middle (records go one at a time) and turns them on again. At the
 * end the first thread stops with records staged and waits while the second goes on: the
 * recorder's worker must forward them. Runs under the shim only (it needs the C API).
 * Prints "allocations N". */
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include "common.h"

enum { ROUNDS = 3000, TAIL = 5 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t turn_changed = PTHREAD_COND_INITIALIZER;
static int turn;  /* whose turn it is: 0 or 1 */
static int allocations;
static int (*stages_pause)(int);
static volatile int first_is_waiting;

/* One block allocated and freed, then the turn passes to the other thread. */
static void take_turn(int me) {
    pthread_mutex_lock(&lock);
    while (turn != me) pthread_cond_wait(&turn_changed, &lock);
    void *p;
    CHECK(cudaMalloc(&p, 1 << 20));
    CHECK(cudaFree(p));
    allocations++;
    turn = 1 - me;
    pthread_cond_broadcast(&turn_changed);
    pthread_mutex_unlock(&lock);
}

static void *thread_main(void *arg) {
    int me = (int)(size_t)arg;
    for (int i = 0; i < ROUNDS; i++) {
        if (me == 0 && i == ROUNDS / 3) EXPECT(stages_pause(1) == 0, "the stages were not paused");
        if (me == 0 && i == 2 * ROUNDS / 3) EXPECT(stages_pause(0) == 1, "the stages were paused");
        take_turn(me);
    }
    if (me == 0) {
        /* Stop with records staged (a few more than a batch's multiple), wait for the other. */
        for (int i = 0; i < TAIL; i++) {
            void *p;
            CHECK(cudaMalloc(&p, 1 << 20));
            CHECK(cudaFree(p));
            __atomic_fetch_add(&allocations, 1, __ATOMIC_SEQ_CST);
        }
        first_is_waiting = 1;
        pthread_mutex_lock(&lock);
        while (turn != 2) pthread_cond_wait(&turn_changed, &lock);
        pthread_mutex_unlock(&lock);
    } else {
        while (!first_is_waiting) usleep(100);
        /* The second thread goes on for longer than the worker waits before it forwards. */
        for (int i = 0; i < 100; i++) {
            void *p;
            CHECK(cudaMalloc(&p, 1 << 20));
            CHECK(cudaFree(p));
            __atomic_fetch_add(&allocations, 1, __ATOMIC_SEQ_CST);
            usleep(200);
        }
        pthread_mutex_lock(&lock);
        turn = 2;
        pthread_cond_broadcast(&turn_changed);
        pthread_mutex_unlock(&lock);
    }
    return NULL;
}

int main(void) {
    stages_pause = (int (*)(int))dlsym(RTLD_DEFAULT, "cachealloc_stages_pause");
    EXPECT(stages_pause != NULL, "the library does not export cachealloc_stages_pause");
    EXPECT(stages_pause(0) == 1, "the stages are paused by default");
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, thread_main, (void *)(size_t)i);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    printf("allocations %d\n", allocations);
    printf("OK stages\n");
    return 0;
}
