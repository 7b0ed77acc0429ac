/* fork while another thread allocates: the child must never touch the parent's pools or locks
 * (it would deadlock if a parent thread held them at the fork). */
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

static volatile int stop;

static void *hammer(void *arg) {
    (void)arg;
    while (!stop) {
        void *p;
        CHECK(cudaMalloc(&p, 4096));
        CHECK(cudaFree(p));
    }
    return NULL;
}

int main(void) {
    void *warm;
    CHECK(cudaMalloc(&warm, 4096));
    pthread_t t;
    pthread_create(&t, NULL, hammer, NULL);
    for (int i = 0; i < 50; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            size_t f, total;
            /* A CUDA call in the child goes straight to the runtime. Real CUDA refuses it in
             * the child of an initialized parent; what matters is that it returns at all. */
            (void)cudaMemGetInfo(&f, &total);
            _exit(0);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child %d ended with status %d", i, status);
    }
    stop = 1;
    pthread_join(t, NULL);
    CHECK(cudaFree(warm));
    printf("OK fork\n");
    return 0;
}
