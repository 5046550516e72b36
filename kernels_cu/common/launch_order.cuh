// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic stream serialization attribute
// (cuflash/launch.py, programmatic=True) may start while the kernel before it on the stream still runs;
// grid_dependency_wait() holds it until that kernel has finished and its memory is visible, and that kernel's
// launch_dependents() lets it start early. Both are no-ops for an ordinary launch, and compile to nothing before sm_90.
#pragma once

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
