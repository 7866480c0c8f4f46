// fastfeed._hsv: Ultralytics' RandomHSV (BGR->HSV, a per-channel lookup, HSV->BGR) in one pass,
// with OpenCV 5's arithmetic, bit for bit.
//
// Ultralytics runs cv2.cvtColor(COLOR_BGR2HSV), cv2.LUT and cv2.cvtColor(COLOR_HSV2BGR): three
// passes over the image and two temporaries. Here each pixel goes through all three steps in
// registers: eight pixels at a time with AVX2, sixteen with AVX-512 (one template over either
// ISA's operations), and the scalar reference for a row's last few. The table's entries are
// computed in the lanes where arithmetic gives every one of them (see Luts).
//
// The arithmetic is OpenCV 5's (modules/imgproc/src/color_hsv.simd.hpp):
// - BGR->HSV in integers: v = max, diff = v - min, s = (diff * sdiv[v] + 2^11) >> 12,
//   h from the sector of the maximum times hdiv[diff], rounded the same way, plus 180 if
//   negative; sdiv[i] = cvRound(255 * 2^12 / i), hdiv[i] = cvRound(180 * 2^12 / 6 / i).
// - HSV->BGR in float32: h * (6/180), s and v times 1/255, the sector's four values
//   v, v(1-s), v*fma(-s, f, 1), v*fma(-s, 1-f, 1) (OpenCV's x86 build fuses those two), times
//   255, truncated to uint8 (OpenCV 4 rounds instead; fastfeed.ultralytics.hsv checks which
//   before it takes this path).
// The file is compiled with -ffp-contract=off: only the two explicit fma calls may fuse.
//
// Two entry points share that arithmetic: hsv_jitter rewrites an interleaved image in place;
// gather_jittered applies it while gathering H x W x 3 images (mirrored or not) into a batch's
// C x H x W planes, so that the batch's layout change and the jitter are one pass.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_features.h"

namespace py = pybind11;

namespace {

constexpr int kShift = 12;
constexpr int kHalf = 1 << (kShift - 1);
constexpr int kSatNumerator = 255 << kShift, kHueNumerator = (180 << kShift) / 6;
constexpr float kToSector = 6.f / 180.f, kToUnit = 1.f / 255.f;

// numerator / i rounded half to even (cvRound of the double quotient), 0 for i = 0.
int rounded_quotient(int numerator, int i) {
    if (i == 0) return 0;
    const int q = numerator / i, rem = numerator % i;
    return (2 * rem > i || (2 * rem == i && (q & 1))) ? q + 1 : q;
}

struct Tables {
    int32_t sdiv[256], hdiv[256];
    Tables() {
        for (int i = 0; i < 256; ++i) {
            sdiv[i] = rounded_quotient(kSatNumerator, i);
            hdiv[i] = rounded_quotient(kHueNumerator, i);
        }
    }
};

const Tables& tables() {
    static const Tables t;
    return t;
}

// Where the value and saturation rows' entries come from a scale (x * scale, clamped to
// [0, 255], floored) and the hue row's from a shift ((x + shift) mod 180), as in every table
// Ultralytics draws, the vector path computes them instead of gathering them: the kernel then
// takes 0.86x the time on a Zen 1 core, whose gathers are slow. Each table is checked against
// that arithmetic entry by entry (fit_arithmetic), and any other table is gathered as it
// stands: the bytes are the table's either way.
struct Luts {
    int32_t h[256], s[256], v[256];
    bool arithmetic = false;
    int32_t hue_shift = 0;
    float sat_scale = 0.f, val_scale = 0.f;
};

// A value or saturation entry as the arithmetic path computes it (the lanes do the same
// float32 operations, so the scalar check below speaks for them).
inline float scaled(float x, float scale) {
    return std::floor(std::min(std::max(x * scale, 0.f), 255.f));
}

// The float32 scale that reproduces row[0..255], if one does: the middle of the scales each
// entry allows (floor(x * scale) = row[x], or at least 255 for a clamped 255), then checked.
bool fit_scale(const int32_t* row, float& scale) {
    double lo = 0.0, hi = INFINITY;
    for (int x = 1; x < 256; ++x) {
        if (row[x] > 0) lo = std::max(lo, static_cast<double>(row[x]) / x);
        if (row[x] < 255) hi = std::min(hi, (row[x] + 1.0) / x);
    }
    scale = static_cast<float>(std::isinf(hi) ? lo * (1.0 + 0x1p-20) : (lo + hi) / 2);
    for (int x = 0; x < 256; ++x) {
        if (scaled(static_cast<float>(x), scale) != static_cast<float>(row[x])) return false;
    }
    return true;
}

// Whether the hue row is a shift mod 180 over the hues there are (0 to 179).
bool fit_shift(const int32_t* row, int32_t& shift) {
    shift = row[0];
    if (shift < 0 || shift >= 180) return false;
    for (int x = 0; x < 180; ++x) {
        if (row[x] != (x + shift) % 180) return false;
    }
    return true;
}

void fit_arithmetic(Luts& lut) {
    lut.arithmetic = fit_shift(lut.h, lut.hue_shift) && fit_scale(lut.s, lut.sat_scale)
                     && fit_scale(lut.v, lut.val_scale);
}

// One pixel's (b, g, r) through the jitter: the reference for the vector path, and its tail.
FASTFEED_AVX2_FMA inline void jitter_values(int b, int g, int r, const Luts& lut,
                                            const Tables& t, uint8_t out_bgr[3]) {
    const int value = std::max(std::max(b, g), r);
    const int diff = value - std::min(std::min(b, g), r);
    const int sat = (diff * t.sdiv[value] + kHalf) >> kShift;
    const int hue6 = value == r ? g - b : (value == g ? b - r + 2 * diff : r - g + 4 * diff);
    int hue = (hue6 * t.hdiv[diff] + kHalf) >> kShift;
    hue += hue < 0 ? 180 : 0;

    float h = static_cast<float>(lut.h[hue]) * kToSector;
    const float s = static_cast<float>(lut.s[sat]) * kToUnit;
    const float v = static_cast<float>(lut.v[value]) * kToUnit;
    h = h >= 6.f ? h - 6.f : h;
    const float floor_h = std::floor(h);
    const float f = h - floor_h;
    const int sector = std::clamp(static_cast<int>(floor_h), 0, 5);
    const float p = v * (1.f - s);
    const float q = v * std::fma(-s, f, 1.f);
    const float u = v * std::fma(-s, 1.f - f, 1.f);
    // (b, g, r) by sector: (p,u,v) (p,v,q) (u,v,p) (v,q,p) (v,p,u) (q,p,v)
    const float out[3] = {
        sector <= 1 ? p : sector == 2 ? u : sector <= 4 ? v : q,
        sector == 0 ? u : sector <= 2 ? v : sector == 3 ? q : p,
        sector == 0 ? v : sector == 1 ? q : sector <= 3 ? p : sector == 4 ? u : v};
    for (int c = 0; c < 3; ++c) {
        out_bgr[c] = static_cast<uint8_t>(std::clamp(static_cast<int>(out[c] * 255.f), 0, 255));
    }
}

// The pixel's three channels through the jitter, in place.
inline void jitter_pixel(uint8_t* px, const Luts& lut, const Tables& t) {
    jitter_values(px[0], px[1], px[2], lut, t, px);
}

#if defined(__x86_64__) || defined(__i386__)
// The vector operations of the jitter at one width: Avx2 (eight int32 or float32 lanes) or
// Avx512 (sixteen). A comparison gives that ISA's lane mask, and select(mask, a, b) takes b
// where the mask is set. jitter_lanes below is written once over these; the row drivers that
// call it are flattened, so every operation is inlined into code built for its ISA.
struct Avx2 {
    using I = __m256i;
    using F = __m256;
    using M = __m256;  // all ones in a lane where true
    static constexpr int kLanes = 8;
    FASTFEED_AVX2_FMA static I set(int v) { return _mm256_set1_epi32(v); }
    FASTFEED_AVX2_FMA static F set(float v) { return _mm256_set1_ps(v); }
    FASTFEED_AVX2_FMA static I max(I a, I b) { return _mm256_max_epi32(a, b); }
    FASTFEED_AVX2_FMA static I min(I a, I b) { return _mm256_min_epi32(a, b); }
    FASTFEED_AVX2_FMA static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    FASTFEED_AVX2_FMA static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
    FASTFEED_AVX2_FMA static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
    FASTFEED_AVX2_FMA static I shift_right(I a) { return _mm256_srai_epi32(a, kShift); }
    FASTFEED_AVX2_FMA static I gather(const int32_t* table, I index) {
        return _mm256_i32gather_epi32(table, index, 4);
    }
    FASTFEED_AVX2_FMA static I rounded_quotient(float numerator, I divisor) {  // half to even
        return _mm256_cvtps_epi32(_mm256_div_ps(_mm256_set1_ps(numerator),
                                                _mm256_cvtepi32_ps(divisor)));
    }
    FASTFEED_AVX2_FMA static M equal(I a, I b) { return _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)); }
    FASTFEED_AVX2_FMA static M less(I a, I b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, a)); }
    FASTFEED_AVX2_FMA static M at_least(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
    FASTFEED_AVX2_FMA static M either(M a, M b) { return _mm256_or_ps(a, b); }
    FASTFEED_AVX2_FMA static I select(M m, I a, I b) {
        return _mm256_blendv_epi8(a, b, _mm256_castps_si256(m));
    }
    FASTFEED_AVX2_FMA static F select(M m, F a, F b) { return _mm256_blendv_ps(a, b, m); }
    FASTFEED_AVX2_FMA static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
    FASTFEED_AVX2_FMA static I truncate(F a) { return _mm256_cvttps_epi32(a); }
    FASTFEED_AVX2_FMA static F add(F a, F b) { return _mm256_add_ps(a, b); }
    FASTFEED_AVX2_FMA static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    FASTFEED_AVX2_FMA static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    FASTFEED_AVX2_FMA static F min(F a, F b) { return _mm256_min_ps(a, b); }
    FASTFEED_AVX2_FMA static F max(F a, F b) { return _mm256_max_ps(a, b); }
    FASTFEED_AVX2_FMA static F floor(F a) { return _mm256_floor_ps(a); }
    FASTFEED_AVX2_FMA static F negated_fma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
};

struct Avx512 {
    using I = __m512i;
    using F = __m512;
    using M = __mmask16;
    static constexpr int kLanes = 16;
    FASTFEED_AVX512 static I set(int v) { return _mm512_set1_epi32(v); }
    FASTFEED_AVX512 static F set(float v) { return _mm512_set1_ps(v); }
    FASTFEED_AVX512 static I max(I a, I b) { return _mm512_max_epi32(a, b); }
    FASTFEED_AVX512 static I min(I a, I b) { return _mm512_min_epi32(a, b); }
    FASTFEED_AVX512 static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    FASTFEED_AVX512 static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
    FASTFEED_AVX512 static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
    FASTFEED_AVX512 static I shift_right(I a) { return _mm512_srai_epi32(a, kShift); }
    FASTFEED_AVX512 static I gather(const int32_t* table, I index) {
        return _mm512_i32gather_epi32(index, table, 4);
    }
    FASTFEED_AVX512 static I rounded_quotient(float numerator, I divisor) {
        return _mm512_cvtps_epi32(_mm512_div_ps(_mm512_set1_ps(numerator),
                                                _mm512_cvtepi32_ps(divisor)));
    }
    FASTFEED_AVX512 static M equal(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
    FASTFEED_AVX512 static M less(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
    FASTFEED_AVX512 static M at_least(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
    FASTFEED_AVX512 static M either(M a, M b) { return a | b; }
    FASTFEED_AVX512 static I select(M m, I a, I b) { return _mm512_mask_blend_epi32(m, a, b); }
    FASTFEED_AVX512 static F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, a, b); }
    FASTFEED_AVX512 static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
    FASTFEED_AVX512 static I truncate(F a) { return _mm512_cvttps_epi32(a); }
    FASTFEED_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
    FASTFEED_AVX512 static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    FASTFEED_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    FASTFEED_AVX512 static F min(F a, F b) { return _mm512_min_ps(a, b); }
    FASTFEED_AVX512 static F max(F a, F b) { return _mm512_max_ps(a, b); }
    FASTFEED_AVX512 static F floor(F a) {
        return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    }
    FASTFEED_AVX512 static F negated_fma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
};

// kLanes pixels' channels, one int32 lane each.
template <class V>
struct Bgr {
    typename V::I b, g, r;
};

// kLanes pixels through the jitter: the same operations as jitter_values, lane by lane. The
// tables' quotients are divided afresh, in float32 rounded half to even: that gives every entry
// of both tables exactly (numerators below 2^20, divisors 1 to 255: checked for each divisor
// by the tests of every colour), and a division costs less than a gather (a third of the
// kernel's time on a Zen 1 core was its five gathers). A divisor of 0 (a black or grey pixel)
// is taken as 1: the quotient then multiplies 0, as the tables' 0 entry does.
template <class V, bool kArithmetic>
inline Bgr<V> jitter_lanes(Bgr<V> px, const Luts& lut) {
    using I = typename V::I;
    using F = typename V::F;
    using M = typename V::M;
    const I b = px.b, g = px.g, r = px.r;
    const I value = V::max(V::max(b, g), r);
    const I diff = V::sub(value, V::min(V::min(b, g), r));
    const I half = V::set(kHalf), one = V::set(1);
    const I sdiv = V::rounded_quotient(kSatNumerator, V::max(value, one));
    const I sat = V::shift_right(V::add(V::mul(diff, sdiv), half));
    const I diff2 = V::add(diff, diff);
    const I from_r = V::sub(g, b);
    const I from_g = V::add(V::sub(b, r), diff2);
    const I from_b = V::add(V::sub(r, g), V::add(diff2, diff2));
    const I hue6 = V::select(V::equal(value, r),
                             V::select(V::equal(value, g), from_b, from_g), from_r);
    const I hdiv = V::rounded_quotient(kHueNumerator, V::max(diff, one));
    I hue = V::shift_right(V::add(V::mul(hue6, hdiv), half));
    hue = V::select(V::less(hue, V::set(0)), hue, V::add(hue, V::set(180)));

    const F unit = V::set(1.f), six = V::set(6.f), to_unit = V::set(kToUnit);
    F h, s, v;
    if constexpr (kArithmetic) {
        const I shifted = V::add(hue, V::set(lut.hue_shift));
        const I wrap = V::set(180);
        h = V::to_float(V::select(V::less(shifted, wrap), V::sub(shifted, wrap), shifted));
        const F zero = V::set(0.f), top = V::set(255.f);
        s = V::floor(V::min(V::max(V::mul(V::to_float(sat), V::set(lut.sat_scale)), zero), top));
        v = V::floor(V::min(V::max(V::mul(V::to_float(value), V::set(lut.val_scale)), zero), top));
    } else {
        h = V::to_float(V::gather(lut.h, hue));
        s = V::to_float(V::gather(lut.s, sat));
        v = V::to_float(V::gather(lut.v, value));
    }
    h = V::mul(h, V::set(kToSector));
    s = V::mul(s, to_unit);
    v = V::mul(v, to_unit);
    h = V::select(V::at_least(h, six), h, V::sub(h, six));
    const F floor_h = V::floor(h);
    const F f = V::sub(h, floor_h);
    const I sector = V::min(V::max(V::truncate(floor_h), V::set(0)), V::set(5));
    const F p = V::mul(v, V::sub(unit, s));
    const F q = V::mul(v, V::negated_fma(s, f, unit));
    const F u = V::mul(v, V::negated_fma(s, V::sub(unit, f), unit));
    const M s0 = V::equal(sector, V::set(0)), s1 = V::equal(sector, V::set(1));
    const M s2 = V::equal(sector, V::set(2)), s3 = V::equal(sector, V::set(3));
    const M s4 = V::equal(sector, V::set(4));
    // (b, g, r) by sector: (p,u,v) (p,v,q) (u,v,p) (v,q,p) (v,p,u) (q,p,v)
    const F bf = V::select(V::either(s0, s1), V::select(s2, V::select(V::either(s3, s4), q, v), u), p);
    const F gf = V::select(s0, V::select(V::either(s1, s2), V::select(s3, p, q), v), u);
    const F rf = V::select(s0, V::select(s1, V::select(V::either(s2, s3), V::select(s4, v, u), p), q), v);
    const F scale = V::set(255.f);
    return {V::truncate(V::mul(bf, scale)), V::truncate(V::mul(gf, scale)),
            V::truncate(V::mul(rf, scale))};
}

// Eight interleaved BGR pixels (24 bytes) as lanes; `mirrored`: the pixels at p8 are the
// last eight of the eight wanted, in reverse (a mirrored view reads them right to left).
FASTFEED_AVX2_FMA inline Bgr<Avx2> load8(const uint8_t* p8, bool mirrored) {
    // Byte shuffles between 24 interleaved BGR bytes (16 + 8) and the planes [B G] and [R].
    const __m128i lo_to_bg = _mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, 1, 4, 7, 10, 13, -1, -1, -1);
    const __m128i hi_to_bg = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 2, 5, -1, -1, -1, -1, -1, 0, 3, 6);
    const __m128i lo_to_r = _mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i hi_to_r = _mm_setr_epi8(-1, -1, -1, -1, -1, 1, 4, 7, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p8));
    const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p8 + 16));
    const __m128i bg = _mm_or_si128(_mm_shuffle_epi8(lo, lo_to_bg), _mm_shuffle_epi8(hi, hi_to_bg));
    const __m128i r8 = _mm_or_si128(_mm_shuffle_epi8(lo, lo_to_r), _mm_shuffle_epi8(hi, hi_to_r));
    Bgr<Avx2> px{_mm256_cvtepu8_epi32(bg), _mm256_cvtepu8_epi32(_mm_srli_si128(bg, 8)),
                 _mm256_cvtepu8_epi32(r8)};
    if (mirrored) {
        const __m256i reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
        px = {_mm256_permutevar8x32_epi32(px.b, reverse),
              _mm256_permutevar8x32_epi32(px.g, reverse),
              _mm256_permutevar8x32_epi32(px.r, reverse)};
    }
    return px;
}

// The inverse of load8 (not mirrored): lanes of values in [0, 255] back to 24 interleaved bytes.
FASTFEED_AVX2_FMA inline void store8(uint8_t* p8, Bgr<Avx2> px) {
    const __m128i bg_to_lo = _mm_setr_epi8(0, 8, -1, 1, 9, -1, 2, 10, -1, 3, 11, -1, 4, 12, -1, 5);
    const __m128i r_to_lo = _mm_setr_epi8(-1, -1, 0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, -1);
    const __m128i bg_to_hi = _mm_setr_epi8(13, -1, 6, 14, -1, 7, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i r_to_hi = _mm_setr_epi8(-1, 5, -1, -1, 6, -1, -1, 7, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i zero = _mm256_setzero_si256();
    // The saturating packs only narrow: the values already lie in [0, 255].
    const __m256i bg16 = _mm256_packus_epi32(px.b, px.g);  // per 128-bit lane
    const __m256i r16 = _mm256_packus_epi32(px.r, zero);
    const __m256i bg_order = _mm256_permute4x64_epi64(bg16, 0xD8);  // b0-7, g0-7 as int16
    const __m256i r_order = _mm256_permute4x64_epi64(r16, 0xD8);
    const __m128i bg_out = _mm_packus_epi16(_mm256_castsi256_si128(bg_order),
                                            _mm256_extracti128_si256(bg_order, 1));
    const __m128i r_out = _mm_packus_epi16(_mm256_castsi256_si128(r_order),
                                           _mm256_castsi256_si128(r_order));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p8),
                     _mm_or_si128(_mm_shuffle_epi8(bg_out, bg_to_lo), _mm_shuffle_epi8(r_out, r_to_lo)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p8 + 16),
                     _mm_or_si128(_mm_shuffle_epi8(bg_out, bg_to_hi), _mm_shuffle_epi8(r_out, r_to_hi)));
}

// Eight values in [0, 255] (int32 lanes) as eight bytes at `dst`.
FASTFEED_AVX2_FMA inline void store_plane(uint8_t* dst, __m256i x) {
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
}

// Sixteen values in [0, 255] (int32 lanes) as sixteen bytes at `dst`.
FASTFEED_AVX512 inline void store_plane(uint8_t* dst, __m512i x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(x));
}

// The V-wide pixels at p (interleaved, V::kLanes of them; mirrored as in load8).
FASTFEED_AVX2_FMA inline Bgr<Avx2> load(const uint8_t* p, bool mirrored, Avx2) {
    return load8(mirrored ? p - 21 : p, mirrored);
}

FASTFEED_AVX512 inline Bgr<Avx512> load(const uint8_t* p, bool mirrored, Avx512) {
    // Two halves of eight: mirrored, the first half (output pixels 0-7) ends at p.
    const Bgr<Avx2> lo = load8(mirrored ? p - 21 : p, mirrored);
    const Bgr<Avx2> hi = load8(mirrored ? p - 45 : p + 24, mirrored);
    return {_mm512_inserti64x4(_mm512_castsi256_si512(lo.b), hi.b, 1),
            _mm512_inserti64x4(_mm512_castsi256_si512(lo.g), hi.g, 1),
            _mm512_inserti64x4(_mm512_castsi256_si512(lo.r), hi.r, 1)};
}

// Avx512's operations, on a CPU with byte permutes across a whole register (VBMI): the loads
// spread 48 interleaved bytes into the three planes' lanes with a permute apiece, where load8's
// byte shuffles, widenings and inserts take about six times as many instructions.
struct Avx512Vbmi : Avx512 {};

FASTFEED_AVX512_VBMI inline __m512i spread_index(int channel, bool mirrored) {
    alignas(64) uint8_t index[64] = {};
    for (int lane = 0; lane < 16; ++lane) {
        index[4 * lane] = static_cast<uint8_t>(3 * (mirrored ? 15 - lane : lane) + channel);
    }
    return _mm512_load_si512(index);
}

FASTFEED_AVX512_VBMI inline Bgr<Avx512Vbmi> load(const uint8_t* p, bool mirrored, Avx512Vbmi) {
    constexpr __mmask64 kPixels = (1ULL << 48) - 1, kLowBytes = 0x1111111111111111ULL;
    static const __m512i forward[3] = {spread_index(0, false), spread_index(1, false),
                                       spread_index(2, false)};
    static const __m512i backward[3] = {spread_index(0, true), spread_index(1, true),
                                        spread_index(2, true)};
    // Mirrored, the sixteen pixels end at p's and run right to left.
    const __m512i bytes = _mm512_maskz_loadu_epi8(kPixels, mirrored ? p - 45 : p);
    const __m512i* index = mirrored ? backward : forward;
    return {_mm512_maskz_permutexvar_epi8(kLowBytes, index[0], bytes),
            _mm512_maskz_permutexvar_epi8(kLowBytes, index[1], bytes),
            _mm512_maskz_permutexvar_epi8(kLowBytes, index[2], bytes)};
}

FASTFEED_AVX2_FMA inline void store(uint8_t* p, Bgr<Avx2> px) { store8(p, px); }

FASTFEED_AVX512 inline void store(uint8_t* p, Bgr<Avx512> px) {
    store8(p, {_mm512_castsi512_si256(px.b), _mm512_castsi512_si256(px.g),
               _mm512_castsi512_si256(px.r)});
    store8(p + 24, {_mm512_extracti64x4_epi64(px.b, 1), _mm512_extracti64x4_epi64(px.g, 1),
                    _mm512_extracti64x4_epi64(px.r, 1)});
}

// The rows' drivers at one width, from pixel i on; they return where they stopped.
template <class V, bool kArithmetic>
inline int jitter_row_lanes(uint8_t* px, int i, int n, const Luts& lut) {
    for (; i + V::kLanes <= n; i += V::kLanes) {
        store(px + 3 * i, jitter_lanes<V, kArithmetic>(load(px + 3 * i, false, V{}), lut));
    }
    return i;
}

template <class V>
inline int jitter_row_lanes(uint8_t* px, int i, int n, const Luts& lut) {
    return lut.arithmetic ? jitter_row_lanes<V, true>(px, i, n, lut)
                          : jitter_row_lanes<V, false>(px, i, n, lut);
}

template <class V>
inline void store_planes(uint8_t* const planes[3], int x, const Bgr<V>& px) {
    store_plane(planes[0] + x, px.b);
    store_plane(planes[1] + x, px.g);
    store_plane(planes[2] + x, px.r);
}

template <class V, bool kArithmetic>
inline int gather_row_lanes(const uint8_t* row, bool mirrored, int x, int n, const Luts* lut,
                            uint8_t* const planes[3]) {
    // Mirrored, output pixel x is the row's pixel -x, and the next ones lie to its left.
    const int step = mirrored ? -3 : 3;
    // Jittered, two groups at a time, both read before either is written: their chains are
    // independent, and the core overlaps them (1-6 % less time on a Zen 1 core), which it
    // cannot across the planes' stores, which may alias the tables for all the compiler knows.
    for (; lut != nullptr && x + 2 * V::kLanes <= n; x += 2 * V::kLanes) {
        const int y = x + V::kLanes;
        const Bgr<V> first =
            jitter_lanes<V, kArithmetic>(load(row + step * x, mirrored, V{}), *lut);
        const Bgr<V> second =
            jitter_lanes<V, kArithmetic>(load(row + step * y, mirrored, V{}), *lut);
        store_planes<V>(planes, x, first);
        store_planes<V>(planes, y, second);
    }
    for (; x + V::kLanes <= n; x += V::kLanes) {
        Bgr<V> px = load(row + step * x, mirrored, V{});
        if (lut != nullptr) px = jitter_lanes<V, kArithmetic>(px, *lut);
        store_planes<V>(planes, x, px);
    }
    return x;
}

template <class V>
inline int gather_row_lanes(const uint8_t* row, bool mirrored, int x, int n, const Luts* lut,
                            uint8_t* const planes[3]) {
    return lut != nullptr && lut->arithmetic
               ? gather_row_lanes<V, true>(row, mirrored, x, n, lut, planes)
               : gather_row_lanes<V, false>(row, mirrored, x, n, lut, planes);
}

// Whole rows: AVX-512 where the CPU has it, then AVX2, then the scalar pixels.
__attribute__((flatten)) FASTFEED_AVX512 int jitter_row_avx512(uint8_t* px, int n,
                                                                const Luts& lut) {
    return jitter_row_lanes<Avx2>(px, jitter_row_lanes<Avx512>(px, 0, n, lut), n, lut);
}

__attribute__((flatten)) FASTFEED_AVX2_FMA int jitter_row_avx2(uint8_t* px, int n,
                                                               const Luts& lut) {
    return jitter_row_lanes<Avx2>(px, 0, n, lut);
}

__attribute__((flatten)) FASTFEED_AVX512 int gather_row_avx512(
        const uint8_t* row, bool mirrored, int n, const Luts* lut, uint8_t* const planes[3]) {
    const int x = gather_row_lanes<Avx512>(row, mirrored, 0, n, lut, planes);
    return gather_row_lanes<Avx2>(row, mirrored, x, n, lut, planes);
}

// A mirrored row's first n - n % 16 pixels (as output pixels 0.. read them) into `out`, in
// that order: sixteen pixels to a permute.
FASTFEED_AVX512_VBMI int unmirror_vbmi(const uint8_t* row, int n, uint8_t* out) {
    constexpr __mmask64 kPixels = (1ULL << 48) - 1;
    alignas(64) uint8_t reverse[64] = {};
    for (int i = 0; i < 48; ++i) reverse[i] = static_cast<uint8_t>(45 - 3 * (i / 3) + i % 3);
    const __m512i index = _mm512_load_si512(reverse);
    int x = 0;
    for (; x + 16 <= n; x += 16) {
        const __m512i bytes = _mm512_maskz_loadu_epi8(kPixels, row - 3 * x - 45);
        _mm512_mask_storeu_epi8(out + 3 * x, kPixels, _mm512_permutexvar_epi8(index, bytes));
    }
    return x;
}

__attribute__((flatten)) FASTFEED_AVX512_VBMI int gather_row_vbmi(
        const uint8_t* row, bool mirrored, int n, const Luts* lut, uint8_t* const planes[3],
        std::vector<uint8_t>& scratch) {
    int x = 0;
    if (mirrored && lut != nullptr) {
        // Jittered while read right to left, a row takes half as long again (its loads and
        // the planes' stores run opposite ways); unmirrored first, it runs as a plain one.
        scratch.resize(static_cast<size_t>(n) * 3);
        x = gather_row_lanes<Avx512Vbmi>(scratch.data(), false, 0,
                                         unmirror_vbmi(row, n, scratch.data()), lut, planes);
    } else {
        x = gather_row_lanes<Avx512Vbmi>(row, mirrored, 0, n, lut, planes);
    }
    return gather_row_lanes<Avx2>(row, mirrored, x, n, lut, planes);
}

__attribute__((flatten)) FASTFEED_AVX2_FMA int gather_row_avx2(
        const uint8_t* row, bool mirrored, int n, const Luts* lut, uint8_t* const planes[3]) {
    return gather_row_lanes<Avx2>(row, mirrored, 0, n, lut, planes);
}
#endif

void jitter_row(uint8_t* px, int n, const Luts& lut, const Tables& t) {
    int i = 0;
#if defined(__x86_64__) || defined(__i386__)
    if (has_avx512()) {
        i = jitter_row_avx512(px, n, lut);
    } else if (has_avx2_fma()) {
        i = jitter_row_avx2(px, n, lut);
    }
#endif
    for (; i < n; ++i) jitter_pixel(px + 3 * i, lut, t);
}

Luts expand(uintptr_t lut_ptr) {
    const auto* table = reinterpret_cast<const uint8_t*>(lut_ptr);
    Luts lut;
    for (int i = 0; i < 256; ++i) {
        lut.h[i] = table[i];
        lut.s[i] = table[256 + i];
        lut.v[i] = table[512 + i];
    }
    fit_arithmetic(lut);
    return lut;
}

// In place on an HxWx3 uint8 BGR image whose rows are `stride` bytes apart; `lut` is the
// 3x256 uint8 table of hue, saturation and value.
void hsv_jitter(uintptr_t image, int height, int width, int64_t stride, uintptr_t lut_ptr) {
    const Luts lut = expand(lut_ptr);
    const Tables& t = tables();
    auto* base = reinterpret_cast<uint8_t*>(image);
    py::gil_scoped_release release;
    for (int y = 0; y < height; ++y) {
        jitter_row(base + y * stride, width, lut, t);
    }
}

// An image to gather: the address of its pixel (0, 0), its row stride in bytes, whether it is
// mirrored (its pixels 3 bytes apart right to left, else left to right), whether its planes are
// written R, G, B (else B, G, R), and its 3x256 table (0: copied without the jitter).
using JitterSource = std::tuple<uintptr_t, int64_t, bool, bool, uintptr_t>;

// Gathers HxWx3 uint8 BGR images into a uint8 Nx3xHxW batch at `dst`, each through its own
// table as hsv_jitter would map it, in one pass over its pixels.
void gather_jittered(uintptr_t dst, const std::vector<JitterSource>& sources, int height,
                     int width) {
    std::vector<Luts> luts(sources.size());
    for (size_t n = 0; n < sources.size(); ++n) {
        if (std::get<4>(sources[n]) != 0) luts[n] = expand(std::get<4>(sources[n]));
    }
    const Tables& t = tables();
    const size_t plane = static_cast<size_t>(height) * width;
    auto* out = reinterpret_cast<uint8_t*>(dst);
    [[maybe_unused]] const bool vbmi = has_avx512_vbmi();
    [[maybe_unused]] std::vector<uint8_t> scratch;  // a mirrored row, unmirrored
    py::gil_scoped_release release;
    for (size_t n = 0; n < sources.size(); ++n) {
        const auto& [base, row_stride, mirrored, rgb, lut_ptr] = sources[n];
        const Luts* lut = lut_ptr != 0 ? &luts[n] : nullptr;
        uint8_t* image = out + n * 3 * plane;
        for (int y = 0; y < height; ++y) {
            const auto* row = reinterpret_cast<const uint8_t*>(base) + y * row_stride;
            uint8_t* bgr[3];  // where the row's B, G and R values go
            for (int c = 0; c < 3; ++c) {
                bgr[c] = image + (rgb ? 2 - c : c) * plane + static_cast<size_t>(y) * width;
            }
            int x = 0;
#if defined(__x86_64__) || defined(__i386__)
            if (vbmi) {
                x = gather_row_vbmi(row, mirrored, width, lut, bgr, scratch);
            } else if (has_avx512()) {
                x = gather_row_avx512(row, mirrored, width, lut, bgr);
            } else if (has_avx2_fma()) {
                x = gather_row_avx2(row, mirrored, width, lut, bgr);
            }
#endif
            for (; x < width; ++x) {
                const uint8_t* px = row + (mirrored ? -3 : 3) * x;
                uint8_t value[3] = {px[0], px[1], px[2]};
                if (lut != nullptr) jitter_values(px[0], px[1], px[2], *lut, t, value);
                for (int c = 0; c < 3; ++c) bgr[c][x] = value[c];
            }
        }
    }
}

}  // namespace

PYBIND11_MODULE(_hsv, m) {
    m.doc() = "Ultralytics' RandomHSV in one pass, with OpenCV 5's arithmetic.";
    m.def("available", &has_avx2_fma, "Whether this CPU runs the kernel at full speed (AVX2, FMA).");
    m.def("hsv_jitter", &hsv_jitter, py::arg("image"), py::arg("height"), py::arg("width"),
          py::arg("stride"), py::arg("lut"),
          "Convert an HxWx3 uint8 BGR image (rows `stride` bytes apart) to HSV, map each "
          "channel through a 3x256 uint8 table and convert back, in place, as cv2.cvtColor, "
          "cv2.LUT and cv2.cvtColor do.");
    m.def("computes_table", [](uintptr_t lut) { return expand(lut).arithmetic; }, py::arg("lut"),
          "Whether the vector path computes this 3x256 table's entries rather than gathering "
          "them (its rows are a hue shift and two scales).");
    m.def("gather_jittered", &gather_jittered, py::arg("dst"), py::arg("sources"),
          py::arg("height"), py::arg("width"),
          "Gather HxWx3 uint8 BGR images, each (address, row stride, mirrored, planes as RGB, "
          "table address or 0), into a uint8 Nx3xHxW batch at dst, each mapped as hsv_jitter "
          "maps it (without a table: copied).");
}
