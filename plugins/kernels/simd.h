// What every kernel's vector code needs: whether AVX2 + FMA are on (the library is compiled with -march=native,
// plugins/native.py) and how to keep register-blocked accumulators in registers.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ENGINE_KERNELS_AVX2 1
#endif

// Fully unrolls the constant-count loops over register blocks: without it GCC 12 keeps an array of __m256
// accumulators in memory too, storing each one back every iteration (measured: the value loop of a prefill tile
// ran at half speed).
#define ENGINE_UNROLL _Pragma("GCC unroll 16")
