// Element types and conversions, written without <cuda_fp16.h> so that the
// kernels compile with NVRTC alone (no CUDA headers needed at run time).
#pragma once
#include "e4m3.cuh"

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define CUFLASH_INF __int_as_float(0x7f800000)
#define CUFLASH_LN2 0.69314718055994530942f

// Tag types: fp16 and bf16 tiles are stored as raw 16-bit words; the tag picks
// the MMA instruction and the float conversions.
struct f16_tag {};
struct bf16_tag {};
// fp8 e4m3 (sm_89+ conversions, sm_90a wgmma): raw bytes; attention over fp8 inputs writes bf16.
struct e4m3_tag {};
template <typename Tag> constexpr bool kIsBf16 = false;
template <> constexpr bool kIsBf16<bf16_tag> = true;
template <typename Tag> constexpr bool kIsF32 = false;   // (float32 arrays take `float` as their tag)
template <> constexpr bool kIsF32<float> = true;

template <typename Tag> struct ElemTraits;

template <> struct ElemTraits<f16_tag> {
    static constexpr int kBytes = 2;
    using OutTag = f16_tag;   // the element type of the attention output
    // Two floats -> one 32-bit word {lo, hi}, round to nearest.
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float to_float(u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
};

template <> struct ElemTraits<bf16_tag> {
    static constexpr int kBytes = 2;
    using OutTag = bf16_tag;
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float to_float(u16 x) {
        return __uint_as_float(((u32)x) << 16);
    }
};

// Whether the e4m3 conversions are the sm_89+ instructions or common/e4m3.cuh's integer code (before sm_89, and
// everywhere with -DCUFLASH_SOFTWARE_E4M3, which the tests use to run the latter on newer GPUs).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 890 || defined(CUFLASH_SOFTWARE_E4M3))
#define CUFLASH_E4M3_IN_SOFTWARE 1
#else
#define CUFLASH_E4M3_IN_SOFTWARE 0
#endif

template <> struct ElemTraits<e4m3_tag> {
    static constexpr int kBytes = 1;
    using OutTag = bf16_tag;
    // Four floats -> one 32-bit word {a, b, c, d} (a in the low byte), round to nearest, saturated to
    // +-448 (e4m3 has no infinity).
    static __device__ __forceinline__ u32 pack4(float a, float b, float c, float d) {
#if CUFLASH_E4M3_IN_SOFTWARE
        return f32_to_e4m3(a) | static_cast<u32>(f32_to_e4m3(b)) << 8 | static_cast<u32>(f32_to_e4m3(c)) << 16
               | static_cast<u32>(f32_to_e4m3(d)) << 24;
#else
        u32 r;
        asm("{\n .reg .b16 l, h;\n"
            " cvt.rn.satfinite.e4m3x2.f32 l, %2, %1;\n"
            " cvt.rn.satfinite.e4m3x2.f32 h, %4, %3;\n"
            " mov.b32 %0, {l, h};\n}\n"
            : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
        return r;
#endif
    }
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
