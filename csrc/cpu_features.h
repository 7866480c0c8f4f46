// The kernels' AVX2/FMA code paths: the target attribute that compiles a function for them, and
// the run-time check that this CPU has them. On x86 a build for the baseline ISA would make
// std::fma a slow library call, so those functions are compiled for the target and run only
// where the CPU supports it; elsewhere the compiler's own target is used as it is.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FASTFEED_AVX2_FMA __attribute__((target("avx2,fma")))
inline bool has_avx2_fma() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
#define FASTFEED_AVX2_FMA
inline bool has_avx2_fma() { return true; }
#endif
