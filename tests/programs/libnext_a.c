/* Helper of dlsym_next.c: defines ca_next_probe (1) and asks dlsym(RTLD_NEXT) for the next
 * definition after itself — libnext_b's (2), loaded after it. */
#define _GNU_SOURCE
#include <dlfcn.h>

int ca_next_probe(void) { return 1; }

int ca_next_of_a(void) {
    int (*next)(void) = (int (*)(void))dlsym(RTLD_NEXT, "ca_next_probe");
    return next ? next() : -1;
}
