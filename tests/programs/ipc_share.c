/* A pooled block shared with another process as PyTorch's torch.multiprocessing shares a CUDA
 * tensor, through the library's C API (Note [IPC of pooled memory] in the shim's
 * process/ipc.rs). The block lies inside a pooled segment (it is not the segment's base), or
 * inside an expandable segment with CACHEALLOC_CONF=expandable_segments:True:
 *  - the receiving process (this program run again with "receive ...") maps it, reads the
 *    sender's bytes and writes its own, which the sender sees;
 *  - the sender frees the block while the receiver holds it: the free succeeds, yet the block
 *    is not handed out again;
 *  - once the receiver has let go (closed the mapping, released its counter), the block is
 *    reused.
 * Usage: ipc_share [desc [big]] (under the shim; fakecuda's IPC maps the memory's memfd). Without an
 * argument it shares through the 64-byte handle functions (cachealloc_ipc_share/_open/_close),
 * which refuse a block of an expandable segment; with "desc", through the variable-length
 * description (cachealloc_ipc_share_desc/_open_desc/_close_desc), which shares either kind;
 * "big" shares a block of 48 MiB, which an expandable segment maps in several chunks.
 * EXACT_FDS=1 (fakecuda): with "desc", the descriptors the sender exports for an expandable
 * segment's block are closed once the receiver lets go (the count of open descriptors is back
 * to where it was; a GPU's driver may open descriptors of its own meanwhile), and a second share of
 * the block sends the first's descriptors instead of exporting again. EXPECT_REFUSAL=1:
 * with "desc", sharing the block must fail (a device whose memory cannot be exported).
 * MEMPOOL=1: the sender's blocks come from a MemPool (a private pool: cudaMallocAsync on a stream
 * while the thread allocates to it), which keeps its maps (Note [Expandable private pools]). */
#include <dirent.h>
#include <dlfcn.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

static int (*share)(uint64_t, unsigned char *, uint64_t *, char *, size_t, uint64_t *);
static uint64_t (*open_handle)(const unsigned char *);
static int (*close_handle)(const unsigned char *);
static size_t (*share_desc)(uint64_t, unsigned char *, size_t, char *, size_t, uint64_t *);
static uint64_t (*open_desc)(const unsigned char *, size_t);
static int (*close_desc)(const unsigned char *, size_t);
static int (*release_counter)(const char *, uint64_t);

static void *api(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    EXPECT(f != NULL, "the library does not export %s", name);
    return f;
}

/* MEMPOOL=1: the sender's allocations go to a MemPool, from a stream. */
static cudaStream_t pool_stream;
static int in_pool;

static cudaError_t alloc(void **p, size_t size) {
    return in_pool ? cudaMallocAsync(p, size, pool_stream) : cudaMalloc(p, size);
}

static cudaError_t release(void *p) {
    if (!in_pool) return cudaFree(p);
    cudaError_t e = cudaFreeAsync(p, pool_stream);
    return e != cudaSuccess ? e : cudaStreamSynchronize(pool_stream);
}

static void enter_mem_pool(void) {
    int (*retain)(int, uint64_t, unsigned, void *, void *) =
        (int (*)(int, uint64_t, unsigned, void *, void *))api("cachealloc_mem_pool_retain");
    int (*begin_thread)(int, uint64_t) = (int (*)(int, uint64_t))api("cachealloc_mem_pool_begin_thread");
    CHECK(cudaStreamCreateWithFlags(&pool_stream, cudaStreamNonBlocking));
    EXPECT(retain(0, 31, 0, NULL, NULL) == 1, "a new MemPool");
    EXPECT(begin_thread(0, 31) == 0, "routing to the MemPool");
    in_pool = 1;
}

static void hex(const unsigned char *h, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", h[i]);
}

static size_t unhex(const char *s, unsigned char *h, size_t max) {
    size_t n = strlen(s) / 2;
    EXPECT(n <= max, "a description of %zu bytes", n);
    for (size_t i = 0; i < n; i++) sscanf(s + 2 * i, "%2hhx", &h[i]);
    return n;
}

static uint64_t u64_at(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Open descriptors other than sockets (the library's descriptor server listens on one from the
 * first export on, for the rest of the process). */
static int open_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    EXPECT(d != NULL, "/proc/self/fd");
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char path[300], target[64];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t len = readlink(path, target, sizeof target - 1);
        if (len > 0) target[len] = 0;
        if (len > 0 && strncmp(target, "socket:", 7) == 0) continue;
        n++;
    }
    closedir(d);
    return n;
}

enum { DESC = 4096 };
static size_t block_bytes = 4096;

/* The sender's bytes: 0x3c + i in the block's i-th MiB (so that memory mapped out of order
 * shows). */
static void fill_pattern(char *p) {
    for (size_t at = 0, i = 0; at < block_bytes; at += 1 << 20, i++) {
        size_t n = block_bytes - at < (1 << 20) ? block_bytes - at : (1 << 20);
        CHECK(cudaMemset(p + at, 0x3c + (int)i, n));
    }
}

static int pattern_ok(const char *p) {
    for (size_t at = 0, i = 0; at < block_bytes; at += 1 << 20, i++) {
        size_t n = block_bytes - at < (1 << 20) ? block_bytes - at : (1 << 20);
        if (first_wrong_byte(p + at, (unsigned char)(0x3c + i), n) >= 0) return 0;
    }
    return 1;
}

/* The receiver: map, check, write, wait for the word, let go. */
static int receive(char **argv, int to_sender, int from_sender) {
    int desc_mode = strcmp(argv[2], "desc") == 0;
    unsigned char handle[DESC];
    size_t len = unhex(argv[3], handle, sizeof handle);
    uint64_t offset = strtoull(argv[4], NULL, 10), slot = strtoull(argv[6], NULL, 10);
    char *p;
    if (desc_mode) {
        uint64_t address = open_desc(handle, len);
        EXPECT(address != 0, "the receiver could not map the block");
        uint64_t again = open_desc(handle, len); /* a second block of the same memory */
        EXPECT(again == address, "the same block opened twice maps at %llx and %llx",
               (unsigned long long)address, (unsigned long long)again);
        EXPECT(close_desc(handle, len) == 0, "closing the second block");
        p = (char *)(uintptr_t)address;
    } else {
        EXPECT(len == 64, "a handle of %zu bytes", len);
        uint64_t base = open_handle(handle);
        EXPECT(base != 0, "the receiver could not map the segment");
        p = (char *)(uintptr_t)(base + offset);
    }
    EXPECT(pattern_ok(p), "the receiver does not see the sender's bytes");
    CHECK(cudaMemset(p, 0x7e, block_bytes));
    CHECK(cudaDeviceSynchronize());
    char c = 'w';
    EXPECT(write(to_sender, &c, 1) == 1, "pipe");
    EXPECT(read(from_sender, &c, 1) == 1, "pipe");
    if (desc_mode) EXPECT(close_desc(handle, len) == 0, "closing the block");
    else EXPECT(close_handle(handle) == 0, "closing the segment");
    EXPECT(release_counter(argv[5], slot) == 0, "releasing the counter");
    printf("OK ipc_share receiver\n");
    return 0;
}

int main(int argc, char **argv) {
    share = (int (*)(uint64_t, unsigned char *, uint64_t *, char *, size_t, uint64_t *))api("cachealloc_ipc_share");
    open_handle = (uint64_t (*)(const unsigned char *))api("cachealloc_ipc_open");
    close_handle = (int (*)(const unsigned char *))api("cachealloc_ipc_close");
    share_desc = (size_t (*)(uint64_t, unsigned char *, size_t, char *, size_t, uint64_t *))api("cachealloc_ipc_share_desc");
    open_desc = (uint64_t (*)(const unsigned char *, size_t))api("cachealloc_ipc_open_desc");
    close_desc = (int (*)(const unsigned char *, size_t))api("cachealloc_ipc_close_desc");
    release_counter = (int (*)(const char *, uint64_t))api("cachealloc_ipc_release");
    if (argc == 10 && strcmp(argv[1], "receive") == 0) {
        block_bytes = strtoull(argv[9], NULL, 10);
        return receive(argv, atoi(argv[7]), atoi(argv[8]));
    }
    int desc_mode = argc > 1 && strcmp(argv[1], "desc") == 0;
    int big = desc_mode && argc > 2 && strcmp(argv[2], "big") == 0;
    if (big) block_bytes = (size_t)48 << 20;
    const char *conf = getenv("CACHEALLOC_CONF");
    int expandable = conf && strstr(conf, "expandable_segments:True");
    int exact_fds = getenv("EXACT_FDS") != NULL;

    if (getenv("MEMPOOL")) enter_mem_pool();
    void *first, *block, *other;
    CHECK(alloc(&first, 4096));
    CHECK(alloc(&block, block_bytes)); /* inside the segment `first` opened, unless big */
    CHECK(alloc(&other, block_bytes));
    fill_pattern(block);
    CHECK(cudaDeviceSynchronize());
    unsigned char handle[DESC];
    size_t len = 64;
    uint64_t offset = 0, slot = 0;
    char counter[128];
    int fds_before = open_fds(), exported = 0;
    if (desc_mode) {
        /* Too small a buffer: the length it needs, and nothing shared. */
        size_t need = share_desc((uint64_t)(uintptr_t)block, handle, 8, counter, sizeof counter, &slot);
        if (getenv("EXPECT_REFUSAL")) {
            EXPECT(need == 0, "a block was shared (%zu bytes)", need);
            printf("OK ipc_share (refused)\n");
            return 0;
        }
        EXPECT(need > 8, "a description that fits in 8 bytes (%zu)", need);
        EXPECT(open_fds() == fds_before || !exact_fds, "a share not made left descriptors open");
        len = share_desc((uint64_t)(uintptr_t)block, handle, sizeof handle, counter, sizeof counter, &slot);
        EXPECT(len == need, "sharing a pooled block failed (%zu, %zu bytes needed)", len, need);
        if (expandable) {
            EXPECT(handle[0] == 2 && len != 64, "not an expandable segment's description (kind %d)", handle[0]);
            uint32_t pid;
            memcpy(&pid, handle + 4, sizeof pid);
            EXPECT(pid == (uint32_t)getpid(), "the description names process %u", pid);
            EXPECT(u64_at(handle + 16) + u64_at(handle + 32) == (uint64_t)(uintptr_t)block,
                   "the range and offset do not name the block");
            uint32_t chunks;
            memcpy(&chunks, handle + 12, sizeof chunks);
            exported = (int)chunks;
            EXPECT(open_fds() == fds_before + exported || !exact_fds, "%d descriptors exported for %u chunks",
                   open_fds() - fds_before, chunks);
            EXPECT(!big || chunks > 1, "a big block in %u chunk", chunks);
            /* A second share of the block (a tensor put on two queues) sends the descriptors the
             * first holds: nothing is exported again. Let go of at once (the sender releases its
             * counter as a receiver would) and a look at the released shares made (a free), the
             * descriptors stay open for the first share. */
            unsigned char twice[DESC];
            char counter2[128];
            uint64_t slot2 = 0;
            size_t len2 = share_desc((uint64_t)(uintptr_t)block, twice, sizeof twice, counter2, sizeof counter2, &slot2);
            EXPECT(len2 == len && memcmp(twice, handle, len) == 0, "a second share exported the memory again");
            EXPECT(open_fds() == fds_before + exported || !exact_fds, "a second share opened %d descriptors",
                   open_fds() - fds_before - exported);
            EXPECT(release_counter(counter2, slot2) == 0, "releasing the second share's counter");
            void *scratch;
            CHECK(alloc(&scratch, 4096));
            CHECK(release(scratch));
            EXPECT(open_fds() == fds_before + exported || !exact_fds,
                   "the first share's descriptors were closed with the second's (%d open of %d)",
                   open_fds() - fds_before, exported);
        } else {
            EXPECT(handle[0] == 1 && len == 80, "not a fixed segment's description (kind %d)", handle[0]);
            offset = u64_at(handle + 8);
            EXPECT(big || offset == (uint64_t)((char *)block - (char *)first), "offset %llu", (unsigned long long)offset);
        }
    } else if (expandable) {
        EXPECT(share((uint64_t)(uintptr_t)block, handle, &offset, counter, sizeof counter, &slot) != 0,
               "a 64-byte handle was given for a block of an expandable segment");
        printf("OK ipc_share (refused)\n");
        return 0;
    } else {
        EXPECT(share((uint64_t)(uintptr_t)block, handle, &offset, counter, sizeof counter, &slot) == 0,
               "sharing a pooled block failed");
        EXPECT(offset == (uint64_t)((char *)block - (char *)first), "offset %llu", (unsigned long long)offset);
    }

    int up[2], down[2];
    EXPECT(pipe(up) == 0 && pipe(down) == 0, "pipe");
    char hexed[2 * DESC + 1], off[32], sl[32], fd_up[16], fd_down[16], size[32];
    snprintf(size, sizeof size, "%zu", block_bytes);
    hex(handle, len, hexed);
    snprintf(off, sizeof off, "%llu", (unsigned long long)offset);
    snprintf(sl, sizeof sl, "%llu", (unsigned long long)slot);
    snprintf(fd_up, sizeof fd_up, "%d", up[1]);
    snprintf(fd_down, sizeof fd_down, "%d", down[0]);
    pid_t child = fork();
    if (child == 0) {
        close(up[0]); /* the receiver sees the sender's end of the pipe close if it dies */
        close(down[1]);
        char *args[] = {argv[0], "receive", desc_mode ? "desc" : "handle", hexed, off, counter, sl, fd_up, fd_down, size, NULL};
        execv("/proc/self/exe", args);
        _exit(127);
    }
    close(up[1]);
    close(down[0]);
    char c;
    EXPECT(read(up[0], &c, 1) == 1, "the receiver died before writing");
    EXPECT(first_wrong_byte(block, 0x7e, block_bytes) < 0, "the sender does not see the receiver's bytes");

    CHECK(release(block)); /* the receiver still holds it */
    void *again;
    CHECK(alloc(&again, block_bytes));
    EXPECT(again != block, "a block another process holds was handed out again");
    int fds_held = open_fds(); /* the exported ones, two ends of pipes, and new memory's */

    EXPECT(write(down[1], "r", 1) == 1, "pipe");
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the receiver failed (status %d)", status);
    close(up[0]);
    close(down[1]);

    CHECK(release(other)); /* frees look at the blocks held for other processes */
    EXPECT(!exact_fds || open_fds() == fds_held - 2 - exported,
           "the sender kept %d of %d exported descriptors open after the receiver let go",
           open_fds() - (fds_held - 2 - exported), exported);
    void *reused;
    CHECK(alloc(&reused, block_bytes));
    EXPECT(reused == block || reused == other, "the block let go of was not freed (got %p, block %p)", reused, block);
    void *second;
    CHECK(alloc(&second, block_bytes));
    EXPECT(reused == block || second == block, "the block let go of was not reused");
    CHECK(release(first));
    CHECK(release(again));
    CHECK(release(reused));
    CHECK(release(second));
    printf("OK ipc_share\n");
    return 0;
}
