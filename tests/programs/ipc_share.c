/* A pooled block shared with another process as PyTorch's torch.multiprocessing shares a CUDA
 * tensor, through the library's C API (Note [IPC of pooled memory] in the shim's
 * process/ipc.rs). The block lies inside a pooled segment (it is not the segment's base):
 *  - the receiving process (this program run again with "receive ...") maps it, reads the
 *    sender's bytes and writes its own, which the sender sees;
 *  - the sender frees the block while the receiver holds it: the free succeeds, yet the block
 *    is not handed out again;
 *  - once the receiver has let go (closed the segment, released its counter), the block is
 *    reused.
 * Usage: ipc_share (under the shim; fakecuda's IPC maps the segment's memfd). */
#include <dlfcn.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

static int (*share)(uint64_t, unsigned char *, uint64_t *, char *, size_t, uint64_t *);
static uint64_t (*open_handle)(const unsigned char *);
static int (*close_handle)(const unsigned char *);
static int (*release_counter)(const char *, uint64_t);

static void *api(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    EXPECT(f != NULL, "the library does not export %s", name);
    return f;
}

static void hex(const unsigned char *h, char *out) {
    for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", h[i]);
}

static void unhex(const char *s, unsigned char *h) {
    for (int i = 0; i < 64; i++) sscanf(s + 2 * i, "%2hhx", &h[i]);
}

enum { BYTES = 4096 };

/* The receiver: map, check, write, wait for the word, let go. */
static int receive(char **argv, int to_sender, int from_sender) {
    unsigned char handle[64];
    unhex(argv[2], handle);
    uint64_t offset = strtoull(argv[3], NULL, 10), slot = strtoull(argv[5], NULL, 10);
    uint64_t base = open_handle(handle);
    EXPECT(base != 0, "the receiver could not map the segment");
    char *p = (char *)(uintptr_t)(base + offset);
    EXPECT(first_wrong_byte(p, 0x3c, BYTES) < 0, "the receiver does not see the sender's bytes");
    CHECK(cudaMemset(p, 0x7e, BYTES));
    CHECK(cudaDeviceSynchronize());
    char c = 'w';
    EXPECT(write(to_sender, &c, 1) == 1, "pipe");
    EXPECT(read(from_sender, &c, 1) == 1, "pipe");
    EXPECT(close_handle(handle) == 0, "closing the segment");
    EXPECT(release_counter(argv[4], slot) == 0, "releasing the counter");
    printf("OK ipc_share receiver\n");
    return 0;
}

int main(int argc, char **argv) {
    share = (int (*)(uint64_t, unsigned char *, uint64_t *, char *, size_t, uint64_t *))api("cachealloc_ipc_share");
    open_handle = (uint64_t (*)(const unsigned char *))api("cachealloc_ipc_open");
    close_handle = (int (*)(const unsigned char *))api("cachealloc_ipc_close");
    release_counter = (int (*)(const char *, uint64_t))api("cachealloc_ipc_release");
    if (argc == 8 && strcmp(argv[1], "receive") == 0)
        return receive(argv, atoi(argv[6]), atoi(argv[7]));

    void *first, *block, *other;
    CHECK(cudaMalloc(&first, BYTES));
    CHECK(cudaMalloc(&block, BYTES)); /* inside the segment `first` opened */
    CHECK(cudaMalloc(&other, BYTES));
    CHECK(cudaMemset(block, 0x3c, BYTES));
    CHECK(cudaDeviceSynchronize());
    unsigned char handle[64];
    uint64_t offset = 0, slot = 0;
    char counter[128];
    EXPECT(share((uint64_t)(uintptr_t)block, handle, &offset, counter, sizeof counter, &slot) == 0,
           "sharing a pooled block failed");
    EXPECT(offset == (uint64_t)((char *)block - (char *)first), "offset %llu", (unsigned long long)offset);

    int up[2], down[2];
    EXPECT(pipe(up) == 0 && pipe(down) == 0, "pipe");
    char hexed[129], off[32], sl[32], fd_up[16], fd_down[16];
    hex(handle, hexed);
    snprintf(off, sizeof off, "%llu", (unsigned long long)offset);
    snprintf(sl, sizeof sl, "%llu", (unsigned long long)slot);
    snprintf(fd_up, sizeof fd_up, "%d", up[1]);
    snprintf(fd_down, sizeof fd_down, "%d", down[0]);
    pid_t child = fork();
    if (child == 0) {
        close(up[0]); /* the receiver sees the sender's end of the pipe close if it dies */
        close(down[1]);
        char *args[] = {argv[0], "receive", hexed, off, counter, sl, fd_up, fd_down, NULL};
        execv("/proc/self/exe", args);
        _exit(127);
    }
    close(up[1]);
    close(down[0]);
    char c;
    EXPECT(read(up[0], &c, 1) == 1, "the receiver died before writing");
    EXPECT(first_wrong_byte(block, 0x7e, BYTES) < 0, "the sender does not see the receiver's bytes");

    CHECK(cudaFree(block)); /* the receiver still holds it */
    void *again;
    CHECK(cudaMalloc(&again, BYTES));
    EXPECT(again != block, "a block another process holds was handed out again");

    EXPECT(write(down[1], "r", 1) == 1, "pipe");
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the receiver failed (status %d)", status);

    CHECK(cudaFree(other)); /* frees look at the blocks held for other processes */
    void *reused;
    CHECK(cudaMalloc(&reused, BYTES));
    EXPECT(reused == block || reused == other, "the block let go of was not freed (got %p, block %p)", reused, block);
    void *second;
    CHECK(cudaMalloc(&second, BYTES));
    EXPECT(reused == block || second == block, "the block let go of was not reused");
    CHECK(cudaFree(first));
    CHECK(cudaFree(again));
    CHECK(cudaFree(reused));
    CHECK(cudaFree(second));
    printf("OK ipc_share\n");
    return 0;
}
