/* dlsym(RTLD_NEXT) and dlsym(RTLD_DEFAULT) answer relative to their caller. Run with
 * LD_PRELOAD="[libcachealloc.so] libnext_a.so libnext_b.so": a library preloaded after the shim
 * that asks for the next definition of a symbol it defines itself must get the one after it. A
 * dlsym interposer that lost track of the caller would hand it its own definition back (and an
 * interposer of malloc built that way recurses forever). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include "common.h"

int main(void) {
    int (*next_of_a)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "ca_next_of_a");
    EXPECT(next_of_a != NULL, "libnext_a.so is not preloaded: %s", dlerror());
    int next = next_of_a();
    EXPECT(next == 2, "dlsym(RTLD_NEXT) from libnext_a found definition %d, not libnext_b's (2)", next);
    int (*first)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "ca_next_probe");
    EXPECT(first && first() == 1, "dlsym(RTLD_DEFAULT) did not find libnext_a's definition first");
    EXPECT(dlsym(RTLD_DEFAULT, "ca_no_such_symbol") == NULL, "a missing symbol was found");
    EXPECT(dlerror() != NULL, "a failed lookup left no dlerror()");
    void *cudart = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    if (cudart) EXPECT(dlsym(cudart, "cudaMalloc") != NULL, "dlsym on an explicit handle found nothing");
    printf("OK dlsym_next\n");
    return 0;
}
