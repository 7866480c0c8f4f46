// fastfeed._hsv: Ultralytics' RandomHSV (BGR->HSV, a per-channel lookup, HSV->BGR) in one pass,
// with OpenCV 5's arithmetic, bit for bit.
//
// Ultralytics runs cv2.cvtColor(COLOR_BGR2HSV), cv2.LUT and cv2.cvtColor(COLOR_HSV2BGR): three
// passes over the image and two temporaries. Here each pixel goes through all three steps in
// registers: eight pixels at a time with AVX2, sixteen with AVX-512 (the same operations, lane
// for lane), and the scalar reference for a row's last few.
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
            sdiv[i] = rounded_quotient(255 << kShift, i);
            hdiv[i] = rounded_quotient((180 << kShift) / 6, i);
        }
    }
};

const Tables& tables() {
    static const Tables t;
    return t;
}

struct Luts {
    int32_t h[256], s[256], v[256];
};

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
// Eight pixels' channels, one int32 lane each.
struct Bgr8 {
    __m256i b, g, r;
};

// Helpers of the vector path. Lambdas would not inherit its target attribute.
FASTFEED_AVX2_FMA inline __m256 is(__m256i sector, int k) {
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(sector, _mm256_set1_epi32(k)));
}

FASTFEED_AVX2_FMA inline __m256 pick(__m256 a, __m256 b, __m256 take_b) {
    return _mm256_blendv_ps(a, b, take_b);
}

FASTFEED_AVX2_FMA inline __m256i to_int(__m256 x, __m256 scale) {
    return _mm256_cvttps_epi32(_mm256_mul_ps(x, scale));
}

// Eight interleaved BGR pixels (24 bytes) as lanes; `mirrored`: the pixels at p8 are the
// last eight of the eight wanted, in reverse (a mirrored view reads them right to left).
FASTFEED_AVX2_FMA inline Bgr8 load8(const uint8_t* p8, bool mirrored) {
    // Byte shuffles between 24 interleaved BGR bytes (16 + 8) and the planes [B G] and [R].
    const __m128i lo_to_bg = _mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, 1, 4, 7, 10, 13, -1, -1, -1);
    const __m128i hi_to_bg = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 2, 5, -1, -1, -1, -1, -1, 0, 3, 6);
    const __m128i lo_to_r = _mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i hi_to_r = _mm_setr_epi8(-1, -1, -1, -1, -1, 1, 4, 7, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p8));
    const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p8 + 16));
    const __m128i bg = _mm_or_si128(_mm_shuffle_epi8(lo, lo_to_bg), _mm_shuffle_epi8(hi, hi_to_bg));
    const __m128i r8 = _mm_or_si128(_mm_shuffle_epi8(lo, lo_to_r), _mm_shuffle_epi8(hi, hi_to_r));
    Bgr8 px{_mm256_cvtepu8_epi32(bg), _mm256_cvtepu8_epi32(_mm_srli_si128(bg, 8)),
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
FASTFEED_AVX2_FMA inline void store8(uint8_t* p8, Bgr8 px) {
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
FASTFEED_AVX2_FMA inline void store_plane8(uint8_t* dst, __m256i x) {
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
}

// Eight pixels through the jitter: the same operations as jitter_values, lane by lane.
FASTFEED_AVX2_FMA inline Bgr8 jitter8(Bgr8 px, const Luts& lut, const Tables& t) {
    const __m256i half = _mm256_set1_epi32(kHalf), full_turn = _mm256_set1_epi32(180);
    const __m256i zero = _mm256_setzero_si256(), five = _mm256_set1_epi32(5);
    const __m256 to_sector = _mm256_set1_ps(kToSector), to_unit = _mm256_set1_ps(kToUnit);
    const __m256 one = _mm256_set1_ps(1.f), six = _mm256_set1_ps(6.f);
    const __m256 scale = _mm256_set1_ps(255.f);
    const __m256i b = px.b, g = px.g, r = px.r;

    const __m256i value = _mm256_max_epi32(_mm256_max_epi32(b, g), r);
    const __m256i diff = _mm256_sub_epi32(value, _mm256_min_epi32(_mm256_min_epi32(b, g), r));
    const __m256i sat = _mm256_srai_epi32(_mm256_add_epi32(
        _mm256_mullo_epi32(diff, _mm256_i32gather_epi32(t.sdiv, value, 4)), half), kShift);
    const __m256i diff2 = _mm256_add_epi32(diff, diff);
    const __m256i from_r = _mm256_sub_epi32(g, b);
    const __m256i from_g = _mm256_add_epi32(_mm256_sub_epi32(b, r), diff2);
    const __m256i from_b = _mm256_add_epi32(_mm256_sub_epi32(r, g), _mm256_add_epi32(diff2, diff2));
    const __m256i hue6 = _mm256_blendv_epi8(
        _mm256_blendv_epi8(from_b, from_g, _mm256_cmpeq_epi32(value, g)), from_r,
        _mm256_cmpeq_epi32(value, r));
    __m256i hue = _mm256_srai_epi32(_mm256_add_epi32(
        _mm256_mullo_epi32(hue6, _mm256_i32gather_epi32(t.hdiv, diff, 4)), half), kShift);
    hue = _mm256_add_epi32(hue, _mm256_and_si256(_mm256_cmpgt_epi32(zero, hue), full_turn));

    __m256 h = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_i32gather_epi32(lut.h, hue, 4)), to_sector);
    const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_i32gather_epi32(lut.s, sat, 4)), to_unit);
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_i32gather_epi32(lut.v, value, 4)), to_unit);
    h = _mm256_blendv_ps(h, _mm256_sub_ps(h, six), _mm256_cmp_ps(h, six, _CMP_GE_OQ));
    const __m256 floor_h = _mm256_floor_ps(h);
    const __m256 f = _mm256_sub_ps(h, floor_h);
    const __m256i sector = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(floor_h), zero), five);
    const __m256 p = _mm256_mul_ps(v, _mm256_sub_ps(one, s));
    const __m256 q = _mm256_mul_ps(v, _mm256_fnmadd_ps(s, f, one));
    const __m256 u = _mm256_mul_ps(v, _mm256_fnmadd_ps(s, _mm256_sub_ps(one, f), one));
    const __m256 s0 = is(sector, 0), s1 = is(sector, 1), s2 = is(sector, 2);
    const __m256 s3 = is(sector, 3), s4 = is(sector, 4);
    // (b, g, r) by sector: (p,u,v) (p,v,q) (u,v,p) (v,q,p) (v,p,u) (q,p,v)
    const __m256 bf = pick(pick(pick(q, v, _mm256_or_ps(s3, s4)), u, s2), p, _mm256_or_ps(s0, s1));
    const __m256 gf = pick(pick(pick(p, q, s3), v, _mm256_or_ps(s1, s2)), u, s0);
    const __m256 rf = pick(pick(pick(pick(v, u, s4), p, _mm256_or_ps(s2, s3)), q, s1), v, s0);
    return {to_int(bf, scale), to_int(gf, scale), to_int(rf, scale)};
}

// Sixteen pixels' channels, one int32 lane each.
struct Bgr16 {
    __m512i b, g, r;
};

FASTFEED_AVX512 inline Bgr16 join(Bgr8 lo, Bgr8 hi) {
    return {_mm512_inserti64x4(_mm512_castsi256_si512(lo.b), hi.b, 1),
            _mm512_inserti64x4(_mm512_castsi256_si512(lo.g), hi.g, 1),
            _mm512_inserti64x4(_mm512_castsi256_si512(lo.r), hi.r, 1)};
}

FASTFEED_AVX512 inline Bgr8 half(Bgr16 px, bool upper) {
    return upper ? Bgr8{_mm512_extracti64x4_epi64(px.b, 1), _mm512_extracti64x4_epi64(px.g, 1),
                        _mm512_extracti64x4_epi64(px.r, 1)}
                 : Bgr8{_mm512_castsi512_si256(px.b), _mm512_castsi512_si256(px.g),
                        _mm512_castsi512_si256(px.r)};
}

FASTFEED_AVX512 inline __m512 pick16(__m512 a, __m512 b, __mmask16 take_b) {
    return _mm512_mask_blend_ps(take_b, a, b);
}

// Sixteen pixels through the jitter: jitter8's operations on twice the lanes (AVX-512 halves
// the arithmetic per pixel; the table lookups stay gathers).
FASTFEED_AVX512 inline Bgr16 jitter16(Bgr16 px, const Luts& lut, const Tables& t) {
    const __m512i half_unit = _mm512_set1_epi32(kHalf), full_turn = _mm512_set1_epi32(180);
    const __m512i zero = _mm512_setzero_si512(), five = _mm512_set1_epi32(5);
    const __m512 to_sector = _mm512_set1_ps(kToSector), to_unit = _mm512_set1_ps(kToUnit);
    const __m512 one = _mm512_set1_ps(1.f), six = _mm512_set1_ps(6.f);
    const __m512 scale = _mm512_set1_ps(255.f);
    const __m512i b = px.b, g = px.g, r = px.r;

    const __m512i value = _mm512_max_epi32(_mm512_max_epi32(b, g), r);
    const __m512i diff = _mm512_sub_epi32(value, _mm512_min_epi32(_mm512_min_epi32(b, g), r));
    const __m512i sat = _mm512_srai_epi32(_mm512_add_epi32(
        _mm512_mullo_epi32(diff, _mm512_i32gather_epi32(value, t.sdiv, 4)), half_unit), kShift);
    const __m512i diff2 = _mm512_add_epi32(diff, diff);
    const __m512i from_r = _mm512_sub_epi32(g, b);
    const __m512i from_g = _mm512_add_epi32(_mm512_sub_epi32(b, r), diff2);
    const __m512i from_b = _mm512_add_epi32(_mm512_sub_epi32(r, g), _mm512_add_epi32(diff2, diff2));
    const __m512i hue6 = _mm512_mask_blend_epi32(
        _mm512_cmpeq_epi32_mask(value, r),
        _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(value, g), from_b, from_g), from_r);
    __m512i hue = _mm512_srai_epi32(_mm512_add_epi32(
        _mm512_mullo_epi32(hue6, _mm512_i32gather_epi32(diff, t.hdiv, 4)), half_unit), kShift);
    hue = _mm512_mask_add_epi32(hue, _mm512_cmplt_epi32_mask(hue, zero), hue, full_turn);

    __m512 h = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_i32gather_epi32(hue, lut.h, 4)), to_sector);
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_i32gather_epi32(sat, lut.s, 4)), to_unit);
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_i32gather_epi32(value, lut.v, 4)), to_unit);
    h = _mm512_mask_sub_ps(h, _mm512_cmp_ps_mask(h, six, _CMP_GE_OQ), h, six);
    const __m512 floor_h = _mm512_roundscale_ps(h, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(h, floor_h);
    const __m512i sector = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(floor_h), zero), five);
    const __m512 p = _mm512_mul_ps(v, _mm512_sub_ps(one, s));
    const __m512 q = _mm512_mul_ps(v, _mm512_fnmadd_ps(s, f, one));
    const __m512 u = _mm512_mul_ps(v, _mm512_fnmadd_ps(s, _mm512_sub_ps(one, f), one));
    const __mmask16 s0 = _mm512_cmpeq_epi32_mask(sector, zero);
    const __mmask16 s1 = _mm512_cmpeq_epi32_mask(sector, _mm512_set1_epi32(1));
    const __mmask16 s2 = _mm512_cmpeq_epi32_mask(sector, _mm512_set1_epi32(2));
    const __mmask16 s3 = _mm512_cmpeq_epi32_mask(sector, _mm512_set1_epi32(3));
    const __mmask16 s4 = _mm512_cmpeq_epi32_mask(sector, _mm512_set1_epi32(4));
    // (b, g, r) by sector: (p,u,v) (p,v,q) (u,v,p) (v,q,p) (v,p,u) (q,p,v)
    const __m512 bf = pick16(pick16(pick16(q, v, s3 | s4), u, s2), p, s0 | s1);
    const __m512 gf = pick16(pick16(pick16(p, q, s3), v, s1 | s2), u, s0);
    const __m512 rf = pick16(pick16(pick16(pick16(v, u, s4), p, s2 | s3), q, s1), v, s0);
    return {_mm512_cvttps_epi32(_mm512_mul_ps(bf, scale)), _mm512_cvttps_epi32(_mm512_mul_ps(gf, scale)),
            _mm512_cvttps_epi32(_mm512_mul_ps(rf, scale))};
}

// Sixteen values in [0, 255] (int32 lanes) as sixteen bytes at `dst`.
FASTFEED_AVX512 inline void store_plane16(uint8_t* dst, __m512i x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(x));
}

// The rows' drivers with AVX-512: sixteen pixels at a time, then the AVX2 ones for the rest.
FASTFEED_AVX512 int jitter_row_avx512(uint8_t* px, int n, const Luts& lut, const Tables& t) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        uint8_t* p16 = px + 3 * i;
        const Bgr16 out = jitter16(join(load8(p16, false), load8(p16 + 24, false)), lut, t);
        store8(p16, half(out, false));
        store8(p16 + 24, half(out, true));
    }
    return i;
}

FASTFEED_AVX512 int gather_row_avx512(const uint8_t* row, bool mirrored, int n, const Luts* lut,
                                      const Tables& t, uint8_t* const planes[3]) {
    int x = 0;
    for (; x + 16 <= n; x += 16) {
        const Bgr8 lo = load8(mirrored ? row - 3 * (x + 7) : row + 3 * x, mirrored);
        const Bgr8 hi = load8(mirrored ? row - 3 * (x + 15) : row + 3 * (x + 8), mirrored);
        Bgr16 px = join(lo, hi);
        if (lut != nullptr) px = jitter16(px, *lut, t);
        store_plane16(planes[0] + x, px.b);
        store_plane16(planes[1] + x, px.g);
        store_plane16(planes[2] + x, px.r);
    }
    return x;
}

FASTFEED_AVX2_FMA void jitter_row_avx2(uint8_t* px, int i, int n, const Luts& lut,
                                       const Tables& t) {
    for (; i + 8 <= n; i += 8) store8(px + 3 * i, jitter8(load8(px + 3 * i, false), lut, t));
    for (; i < n; ++i) jitter_pixel(px + 3 * i, lut, t);
}

// Pixels x.. of one row of gather_jittered, eight at a time; returns where it stopped.
FASTFEED_AVX2_FMA int gather_row_avx2(const uint8_t* row, bool mirrored, int x, int n,
                                      const Luts* lut, const Tables& t, uint8_t* const planes[3]) {
    for (; x + 8 <= n; x += 8) {
        // Mirrored, output pixels x..x+7 are the row's pixels -x-7..-x, stored left to right.
        Bgr8 px = load8(mirrored ? row - 3 * (x + 7) : row + 3 * x, mirrored);
        if (lut != nullptr) px = jitter8(px, *lut, t);
        store_plane8(planes[0] + x, px.b);
        store_plane8(planes[1] + x, px.g);
        store_plane8(planes[2] + x, px.r);
    }
    return x;
}
#endif

void jitter_row(uint8_t* px, int n, const Luts& lut, const Tables& t) {
#if defined(__x86_64__) || defined(__i386__)
    if (has_avx2_fma()) {
        jitter_row_avx2(px, has_avx512() ? jitter_row_avx512(px, n, lut, t) : 0, n, lut, t);
        return;
    }
#endif
    for (int i = 0; i < n; ++i) jitter_pixel(px + 3 * i, lut, t);
}

Luts expand(uintptr_t lut_ptr) {
    const auto* table = reinterpret_cast<const uint8_t*>(lut_ptr);
    Luts lut;
    for (int i = 0; i < 256; ++i) {
        lut.h[i] = table[i];
        lut.s[i] = table[256 + i];
        lut.v[i] = table[512 + i];
    }
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
    py::gil_scoped_release release;
    for (size_t n = 0; n < sources.size(); ++n) {
        const auto& [base, row_stride, mirrored, rgb, lut_ptr] = sources[n];
        const Luts* lut = lut_ptr != 0 ? &luts[n] : nullptr;
        uint8_t* image = out + n * 3 * plane;
        for (int y = 0; y < height; ++y) {
            const auto* row = reinterpret_cast<const uint8_t*>(base) + y * row_stride;
            uint8_t* bgr[3];  // where the row's B, G and R values go
            for (int c = 0; c < 3; ++c) bgr[c] = image + (rgb ? 2 - c : c) * plane + y * width;
            int x = 0;
#if defined(__x86_64__) || defined(__i386__)
            if (has_avx2_fma()) {
                x = has_avx512() ? gather_row_avx512(row, mirrored, width, lut, t, bgr) : 0;
                x = gather_row_avx2(row, mirrored, x, width, lut, t, bgr);
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
    m.def("gather_jittered", &gather_jittered, py::arg("dst"), py::arg("sources"),
          py::arg("height"), py::arg("width"),
          "Gather HxWx3 uint8 BGR images, each (address, row stride, mirrored, planes as RGB, "
          "table address or 0), into a uint8 Nx3xHxW batch at dst, each mapped as hsv_jitter "
          "maps it (without a table: copied).");
}
