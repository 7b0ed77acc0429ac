// Allocates from a member function of a class template in a namespace, so that a native stack's
// frame names show whether C++ symbols are demangled. Prints "OK cpp_names".
#include <cuda_runtime.h>
#include <cstdio>

namespace model {
template <typename T>
struct Buffer {
    static void *allocate(size_t n) {
        void *p = nullptr;
        if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) return nullptr;
        return p;
    }
};
}  // namespace model

int main() {
    void *p = model::Buffer<float>::allocate(1000);
    if (!p || cudaFree(p) != cudaSuccess) return 1;
    std::printf("OK cpp_names\n");
    return 0;
}
