/* cudaIpcGetMemHandle on pooled memory never names the wrong bytes: a block that starts its
 * fixed segment gets the driver's handle (which maps the segment from its base); a block inside
 * a segment, or in an expandable segment (CACHEALLOC_CONF=expandable_segments:True), a handle
 * of the shim's (Note [CUDA's IPC handles for pooled blocks]; cuda_ipc_handles.c opens them in
 * another process); a pointer into a freed pooled block is refused. */
#include "common.h"

static int shims(const cudaIpcMemHandle_t *h) { return memcmp(h, "cacheIPC", 8) == 0; }

int main(void) {
    const char *conf = getenv("CACHEALLOC_CONF");
    int expandable = conf && strstr(conf, "expandable_segments:True");
    void *small1, *small2, *whole;
    cudaIpcMemHandle_t h;
    CHECK(cudaMalloc(&small1, 4096));
    CHECK(cudaMalloc(&small2, 4096));
    CHECK(cudaIpcGetMemHandle(&h, small2));
    EXPECT(shims(&h), "a block inside a segment was given the driver's handle");
    CHECK(cudaMalloc(&whole, 64 << 20));
    CHECK(cudaIpcGetMemHandle(&h, whole));
    EXPECT(shims(&h) == expandable, "a block that is %s was given %s handle",
           expandable ? "in an expandable segment" : "a whole segment", shims(&h) ? "the shim's" : "the driver's");
    CHECK(cudaFree(small2));
    EXPECT(cudaIpcGetMemHandle(&h, small2) != cudaSuccess, "a handle was given for a freed block");
    (void)cudaGetLastError();
    CHECK(cudaFree(small1));
    CHECK(cudaFree(whole));
    printf("OK ipc\n");
    return 0;
}
