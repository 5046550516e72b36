// fp8 e4m3 (OCP "e4m3fn": bias 7, no infinity, 0x7f / 0xff NaN, largest 448) conversions in integer and float
// arithmetic, for GPUs before sm_89 (no cvt ... e4m3x2): the A100 reads and writes fp8 KV caches through them.
// Bit-exact with the hardware instructions on every byte and with round-to-nearest-even, saturating stores
// (tests/test_e4m3.py builds this header as host C++ and checks it against ml_dtypes on all 256 bytes and on
// random floats). Kernels use them where __CUDA_ARCH__ < 890, or everywhere with -DCUFLASH_SOFTWARE_E4M3 (tests).
#pragma once

#ifndef CUFLASH_HD
#define CUFLASH_HD __host__ __device__ __forceinline__
#endif

CUFLASH_HD unsigned e4m3_float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    unsigned u;
    __builtin_memcpy(&u, &x, 4);
    return u;
#endif
}

CUFLASH_HD int e4m3_highest_bit(unsigned x) {   // of x > 0
#ifdef __CUDA_ARCH__
    return 31 - __clz(x);
#else
    return 31 - __builtin_clz(x);
#endif
}

// One e4m3 byte -> its fp16 bits (every e4m3 value is an fp16 one; NaN -> the fp16 quiet NaN of its sign).
CUFLASH_HD unsigned short e4m3_to_f16_bits(unsigned char b) {
    const unsigned sign = (b & 0x80u) << 8;
    const unsigned em = b & 0x7fu;
    if (em == 0x7fu) return static_cast<unsigned short>(sign | 0x7e00u);
    if (em >= 8u) return static_cast<unsigned short>(sign | (((em >> 3) + 8u) << 10) | ((em & 7u) << 7));
    if (em == 0u) return static_cast<unsigned short>(sign);
    // A subnormal, m * 2^-9 (m = 1 .. 7): a normal fp16 of exponent p - 9, p its highest bit.
    const int p = e4m3_highest_bit(em);
    return static_cast<unsigned short>(sign | static_cast<unsigned>(p - 9 + 15) << 10 | ((em << (10 - p)) & 0x3ffu));
}

CUFLASH_HD int e4m3_rint(float x) {   // round to nearest even
#ifdef __CUDA_ARCH__
    return __float2int_rn(x);
#else
    return static_cast<int>(__builtin_rintf(x));
#endif
}

// A float -> e4m3, round to nearest even, saturated to +-448 (as cvt.rn.satfinite; NaN -> 0x7f with its sign).
CUFLASH_HD unsigned char f32_to_e4m3(float x) {
    const unsigned bits = e4m3_float_bits(x);
    const unsigned sign = (bits >> 24) & 0x80u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned char>(sign | 0x7fu);   // NaN
    const float a = fminf(fabsf(x), 448.f);
    // Below 2^-6, steps of 2^-9 (subnormals; 8 steps reach 2^-6, the smallest normal, code 8: also right).
    if (a < 0.015625f) return static_cast<unsigned char>(sign | static_cast<unsigned>(e4m3_rint(a * 512.f)));
    // Normal: the 23-bit mantissa rounded to 3 bits, to nearest even; a carry moves into the exponent.
    const unsigned m = e4m3_float_bits(a);
    const unsigned r = m + 0x7ffffu + ((m >> 20) & 1u);
    return static_cast<unsigned char>(sign | (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
}
