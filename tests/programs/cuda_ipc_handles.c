/* CUDA's own IPC calls on pooled memory, as vLLM's and SGLang's custom all-reduce make them on
 * PyTorch's tensors (Note [CUDA's IPC handles for pooled blocks] in the shim's
 * process/ipc/handles.rs): the allocation's base from cuPointerGetAttribute(RANGE_START_ADDR),
 * cudaIpcGetMemHandle of that base, the pointer's offset beside the handle; the receiving process
 * (this program run again with "receive ...", under the shim too) opens each handle with
 * cudaIpcOpenMemHandle, adds the offset, reads the sender's bytes, writes its own and closes it.
 * Three blocks:
 *  - `first`, a fixed segment's first block: the driver's own handle;
 *  - `inside`, a block inside that segment: a handle of the shim's;
 *  - `mapped`, a stream-ordered block (an expandable segment under the default): a handle of the
 *    shim's, its memory mapped in the receiver from the sender's file descriptors.
 * The shim's handle is the same when asked again; the block's free takes it back (its
 * description file goes: a receiver that opens it then gets an error, "stale ...") and the block
 * is reused at once (nothing waits in limbo).
 * Which blocks get the shim's handle (`first`, `inside`, `mapped`) follows CACHEALLOC_CONF:
 * "011" by default, every one with expandable_segments:True ("111"), none but `inside` with
 * expandable_segments:False ("010": `mapped` is then its own segment's first block).
 * RECEIVER_DEVICE=N: the receiver opens and uses the handles on device N.
 * Usage: cuda_ipc_handles (under the shim). */
#include <dirent.h>
#include <dlfcn.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

enum { BLOCKS = 3, OFFSET = 4096 + 100 };
static const size_t sizes[BLOCKS] = {1 << 20, 1 << 20, 3 << 20};
static const unsigned char patterns[BLOCKS] = {0x3a, 0x4b, 0x5c};

static void *range_start(void *p) {
    typedef int (*get_t)(void *, int, unsigned long long);
    get_t get = (get_t)dlsym(RTLD_DEFAULT, "cuPointerGetAttribute");
    if (!get) get = (get_t)dlsym(dlopen("libcuda.so.1", RTLD_NOW), "cuPointerGetAttribute");
    EXPECT(get != NULL, "no cuPointerGetAttribute");
    void *base = NULL;
    EXPECT(get(&base, 11 /* CU_POINTER_ATTRIBUTE_RANGE_START_ADDR */, (unsigned long long)(uintptr_t)p) == 0,
           "cuPointerGetAttribute(RANGE_START_ADDR) of %p failed", p);
    return base;
}

static void hex(const unsigned char *h, char *out) {
    for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", h[i]);
}

static void unhex(const char *s, unsigned char *h) {
    EXPECT(strlen(s) == 128, "a handle of %zu hex digits", strlen(s));
    for (int i = 0; i < 64; i++) sscanf(s + 2 * i, "%2hhx", &h[i]);
}

/* The shim's description files of process `pid`. */
static int handle_files(int pid) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "cachealloc-ipch-%d-", pid);
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

static int receive(char **argv) {
    /* RECEIVER_DEVICE=1: the receiver works on another device, as each rank of a custom
     * all-reduce opens its peers' buffers on its own GPU. */
    if (getenv("RECEIVER_DEVICE")) CHECK(cudaSetDevice(atoi(getenv("RECEIVER_DEVICE"))));
    for (int i = 0; i < BLOCKS; i++) {
        cudaIpcMemHandle_t h;
        unhex(argv[2 + 2 * i], (unsigned char *)&h);
        size_t offset = strtoull(argv[3 + 2 * i], NULL, 10);
        void *base = NULL;
        CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess));
        char *p = (char *)base + offset;
        size_t n = sizes[i] - OFFSET;
        long bad = first_wrong_byte(p, patterns[i], n);
        EXPECT(bad < 0, "block %d: the receiver reads byte %ld wrong", i, bad);
        CHECK(cudaMemset(p, 0x7e, n));
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaIpcCloseMemHandle(base));
    }
    printf("OK cuda_ipc_handles receiver\n");
    return 0;
}

/* A handle of a block the sender has freed: opening it fails with an error, nothing mapped. */
static int receive_stale(const char *hexed) {
    cudaIpcMemHandle_t h;
    unhex(hexed, (unsigned char *)&h);
    void *base = NULL;
    EXPECT(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess,
           "a handle of a freed block was opened at %p", base);
    (void)cudaGetLastError();
    printf("OK cuda_ipc_handles stale\n");
    return 0;
}

static void run_child(char **args) {
    pid_t child = fork();
    if (child == 0) {
        execv("/proc/self/exe", args);
        _exit(127);
    }
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the receiver (%s) failed (status %d)", args[1], status);
}

int main(int argc, char **argv) {
    if (argc == 2 + 2 * BLOCKS && strcmp(argv[1], "receive") == 0) return receive(argv);
    if (argc == 3 && strcmp(argv[1], "stale") == 0) return receive_stale(argv[2]);
    void *blocks[BLOCKS];
    CHECK(cudaMalloc(&blocks[0], sizes[0]));
    CHECK(cudaMalloc(&blocks[1], sizes[1]));
    CHECK(cudaMallocAsync(&blocks[2], sizes[2], 0));
    for (int i = 0; i < BLOCKS; i++) CHECK(cudaMemset(blocks[i], patterns[i], sizes[i]));
    CHECK(cudaDeviceSynchronize());

    const char *conf = getenv("CACHEALLOC_CONF") ? getenv("CACHEALLOC_CONF") : "";
    const char *expect_ours = strstr(conf, "expandable_segments:True")    ? "111"
                              : strstr(conf, "expandable_segments:False") ? "010"
                                                                          : "011";
    int expected_files = 0;
    for (int i = 0; i < BLOCKS; i++) expected_files += expect_ours[i] == '1';
    char *args[2 + 2 * BLOCKS + 1];
    char hexed[BLOCKS][129], offsets[BLOCKS][32];
    args[0] = argv[0];
    args[1] = "receive";
    for (int i = 0; i < BLOCKS; i++) {
        char *p = (char *)blocks[i] + OFFSET;
        char *base = (char *)range_start(p);
        EXPECT(base == (char *)blocks[i], "block %d: its range starts at %p, not at the block %p", i,
               (void *)base, blocks[i]);
        cudaIpcMemHandle_t h, again;
        CHECK(cudaIpcGetMemHandle(&h, base));
        CHECK(cudaIpcGetMemHandle(&again, base));
        EXPECT(memcmp(&h, &again, sizeof h) == 0, "block %d: a second handle differs", i);
        int ours = memcmp(&h, "cacheIPC", 8) == 0;
        EXPECT(ours == (expect_ours[i] == '1'), "block %d: %s handle", i, ours ? "the shim's" : "the driver's");
        hex((unsigned char *)&h, hexed[i]);
        snprintf(offsets[i], sizeof offsets[i], "%zu", (size_t)(p - base));
        args[2 + 2 * i] = hexed[i];
        args[3 + 2 * i] = offsets[i];
    }
    args[2 + 2 * BLOCKS] = NULL;
    EXPECT(handle_files(getpid()) == expected_files, "%d description files, expected %d", handle_files(getpid()),
           expected_files);

    run_child(args);
    for (int i = 0; i < BLOCKS; i++) {
        long bad = first_wrong_byte((char *)blocks[i] + OFFSET, 0x7e, sizes[i] - OFFSET);
        EXPECT(bad < 0, "block %d: the sender does not see the receiver's byte %ld", i, bad);
    }

    /* The free takes the handles back: no file left, and the blocks reused at once. */
    CHECK(cudaFree(blocks[1]));
    CHECK(cudaFreeAsync(blocks[2], 0));
    CHECK(cudaStreamSynchronize(0));
    EXPECT(handle_files(getpid()) == (expect_ours[0] == '1'), "%d description files left after the frees",
           handle_files(getpid()));
    char *stale[] = {argv[0], "stale", hexed[1], NULL};
    run_child(stale);
    void *inside, *mapped;
    CHECK(cudaMalloc(&inside, sizes[1]));
    CHECK(cudaMallocAsync(&mapped, sizes[2], 0));
    EXPECT(inside == blocks[1] && mapped == blocks[2], "a block given a handle was not reused after its free");
    CHECK(cudaFree(inside));
    CHECK(cudaFreeAsync(mapped, 0));
    CHECK(cudaFree(blocks[0]));
    printf("OK cuda_ipc_handles\n");
    return 0;
}
