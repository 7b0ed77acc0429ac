/* A stand-in for PyTorch's libc10.so in the Python integration's test: c10's profiler memory
 * functions under their C++ names (memoryProfilingEnabled, reportMemoryUsageToProfiler,
 * reportOutOfMemoryToProfiler), recording what the library reports; the test turns the
 * "profiler" on and off and reads the records back (profiler_*). */
#include <stdint.h>
#include <stddef.h>

typedef struct { int8_t type; int8_t index; } Device; /* c10::Device */

enum { MAX_REPORTS = 64 };
typedef struct {
    int kind; /* 1 usage, 2 out of memory */
    uint64_t address;
    int64_t bytes;
    uint64_t allocated, reserved;
    int device_type, device_index;
} report;

static int enabled;
static int count;
static report reports[MAX_REPORTS];

_Bool _ZN3c1022memoryProfilingEnabledEv(void) { return enabled; }

static void note(int kind, void *ptr, int64_t bytes, size_t allocated, size_t reserved, Device d) {
    if (count == MAX_REPORTS) return;
    reports[count++] = (report){kind, (uint64_t)(uintptr_t)ptr, bytes, allocated, reserved, d.type, d.index};
}

void _ZN3c1027reportMemoryUsageToProfilerEPvlmmNS_6DeviceE(void *ptr, int64_t bytes, size_t allocated,
                                                           size_t reserved, Device d) {
    note(1, ptr, bytes, allocated, reserved, d);
}

void _ZN3c1027reportOutOfMemoryToProfilerElmmNS_6DeviceE(int64_t bytes, size_t allocated, size_t reserved,
                                                         Device d) {
    note(2, NULL, bytes, allocated, reserved, d);
}

void profiler_enable(int on) { enabled = on; }
int profiler_count(void) { return count; }
void profiler_clear(void) { count = 0; }
/* Report i: kind, address, bytes, allocated, reserved, device type, device index. */
void profiler_report(int i, int *kind, uint64_t *address, int64_t *bytes, uint64_t *allocated,
                     uint64_t *reserved, int *device_type, int *device_index) {
    *kind = reports[i].kind;
    *address = reports[i].address;
    *bytes = reports[i].bytes;
    *allocated = reports[i].allocated;
    *reserved = reports[i].reserved;
    *device_type = reports[i].device_type;
    *device_index = reports[i].device_index;
}
