// The kernels' AVX2/FMA (and AVX-512) code paths: the target attribute that compiles a function for them, and
// the run-time check that this CPU has them. On x86 a build for the baseline ISA would make
// std::fma a slow library call, so those functions are compiled for the target and run only
// where the CPU supports it; elsewhere the compiler's own target is used as it is.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FASTFEED_AVX2_FMA __attribute__((target("avx2,fma")))
inline bool has_avx2_fma() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
// FASTFEED_ISA=avx2 in the environment keeps a CPU with AVX-512 on the AVX2 paths, so that
// the tests check both (each gives the same bytes) on whichever CPU runs them.
inline bool capped_at_avx2() {
    static const bool capped = [] {
        const char* isa = std::getenv("FASTFEED_ISA");
        return isa != nullptr && std::strcmp(isa, "avx2") == 0;
    }();
    return capped;
}
// AVX-512 with byte and word (BW) and double/quad (DQ) instructions, on top of AVX2 and FMA.
#define FASTFEED_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
inline bool has_avx512() {
    return !capped_at_avx2() && has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
}
// AVX-512 with byte permutes across a whole register (VBMI: Ice Lake and later, Zen 4).
#define FASTFEED_AVX512_VBMI \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx2,fma")))
inline bool has_avx512_vbmi() { return has_avx512() && __builtin_cpu_supports("avx512vbmi"); }
#else
#define FASTFEED_AVX2_FMA
#define FASTFEED_AVX512
#define FASTFEED_AVX512_VBMI
inline bool has_avx2_fma() { return true; }
inline bool has_avx512() { return false; }
inline bool has_avx512_vbmi() { return false; }
#endif
