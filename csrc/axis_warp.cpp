// fastfeed._warp: OpenCV's bilinear warpAffine, bit for bit, for axis-aligned matrices.
//
// Ultralytics' default random perspective (degrees=0, shear=0, perspective=0) scales and
// translates: its matrix has no rotation or shear terms. Then the source column of an output
// pixel depends on its column only, and the source row on its row only, so the bilinear
// interpolation splits into a horizontal pass over the source rows that the output needs and
// a vertical pass over output rows. Each horizontally interpolated row is reused by every
// output row that reads it, and the vertical pass runs over contiguous memory.
//
// OpenCV 5 computes a warp in float32 (modules/imgproc/src/warp_kernels.simd.hpp): the
// inverse matrix in double, then per pixel sx = fma(M0, x, M2), sy = y*M4 + M5, the weights
// a = sx - floor(sx), b = sy - floor(sy), then v0 = fma(a, p01 - p00, p00),
// v1 = fma(a, p11 - p10, p10), out = round_half_even(fma(b, v1 - v0, v0)), with the border
// value in place of any neighbour outside the source. The horizontal pass here computes v0 and
// v1 exactly so, and the vertical pass the last step, so the result is OpenCV's to the bit.
// That equality is an assumption about one OpenCV build; fastfeed.ultralytics.warp checks it
// against cv2 at run time before it takes this path.
//
// The source is a canvas of tiles over the border value: an image is one tile covering it;
// Ultralytics' 2x2 mosaic is four images placed on a grey canvas, and the horizontal pass reads
// the needed parts of each needed row straight from the four, so the canvas is never laid out.
//
// The file is compiled with -ffp-contract=off: a fused y*M4 + M5 would round differently.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_features.h"

namespace py = pybind11;

namespace {

// Source column c of a row sits at c + kPad in the padded row, between border pixels.
constexpr int kPad = 2;

struct Inverse {
    double m0, m2, m4, m5;
};

// The inverse of [[a, 0, b], [0, d, e]] as cv::warpAffine computes it (in double).
Inverse invert(double a, double b, double d, double e) {
    double det = a * d;
    det = det != 0 ? 1. / det : 0;
    const double m0 = d * det, m4 = a * det;
    return {m0, -m0 * b, m4, -m4 * e};
}

// Canvas rows [y1, y2) and columns [x1, x2) hold an image whose pixel at canvas (y1, x1) is at
// `origin`, rows `stride` bytes apart; where tiles overlap, the later one shows.
struct Tile {
    const uint8_t* origin;
    int64_t stride;
    int y1, y2, x1, x2;
};

struct Plan {
    std::vector<int> column;  // padded index of each output column's left neighbour
    std::vector<float> alpha;
    int first = 0, last = -1;  // the source columns that any output column reads
    // Blocks of block_pixels output columns for a vector kernel, where planned; each output
    // value's weight, alpha repeated for B, G and R; byte offsets of windows in a padded row,
    // and per window the offsets of its values' left and right neighbour bytes, one byte per
    // 32-bit lane. interpolate_vbmi (16 columns): a 128-byte window per block, its 48 left and
    // 48 right offsets 16 to a 64-byte index. interpolate_avx2_blocks (8 columns): six 16-byte
    // windows per block, one per 4 values, their offsets as the 32-byte byte-shuffle indices of
    // the block's three 8-value parts, left then right.
    int block_pixels = 0;
    std::vector<size_t> block_start;
    std::vector<uint8_t> block_index;
    std::vector<float> alpha3;
};

FASTFEED_AVX2_FMA Plan plan_columns(const Inverse& inv, int src_w, int out_w) {
    Plan plan;
    plan.column.resize(out_w);
    plan.alpha.resize(out_w);
    const float m0 = static_cast<float>(inv.m0), m2 = static_cast<float>(inv.m2);
    int lo = src_w + 2 * kPad, hi = 0;
    for (int x = 0; x < out_w; ++x) {
        const float sx = std::fma(m0, static_cast<float>(x), m2);
        const float left = std::floor(sx);
        plan.alpha[x] = sx - left;
        // Far outside the source both neighbours are border pixels: clamp into the padding.
        const double padded = std::clamp(static_cast<double>(left) + kPad, 0.0,
                                         static_cast<double>(src_w + kPad));
        plan.column[x] = static_cast<int>(padded);
        lo = std::min(lo, plan.column[x]);
        hi = std::max(hi, plan.column[x] + 1);
    }
    plan.first = std::max(lo - kPad, 0);
    plan.last = std::min(hi - kPad, src_w - 1);
    return plan;
}

// Bytes past a padded row's last pixel: interpolate_vbmi reads 128 bytes from the left
// neighbour of a block's first column (interpolate_avx2 7 bytes from each left neighbour).
constexpr size_t kWindow = 128;
constexpr size_t kSlack = kWindow;

void keep_blocks(Plan& plan, int pixels, std::vector<size_t> start, std::vector<uint8_t> index) {
    plan.block_pixels = pixels;
    plan.block_start = std::move(start);
    plan.block_index = std::move(index);
    plan.alpha3.resize(static_cast<size_t>(plan.column.size() / pixels * pixels) * 3);
    for (size_t i = 0; i < plan.alpha3.size(); ++i) plan.alpha3[i] = plan.alpha[i / 3];
}

// interpolate_vbmi's blocks (see Plan), if every full block's neighbours fit in its window.
void plan_blocks(Plan& plan, int out_w) {
    const int blocks = out_w / 16;
    std::vector<size_t> start(blocks);
    std::vector<uint8_t> index(static_cast<size_t>(blocks) * 6 * 64, 0);
    for (int k = 0; k < blocks; ++k) {
        const int* column = plan.column.data() + 16 * k;
        // Columns run backwards under a mirroring matrix: those blocks are not planned.
        const int span = column[15] - column[0];
        if (span < 0 || span * 3 + 6 > static_cast<int>(kWindow)) return;
        start[k] = static_cast<size_t>(column[0]) * 3;
        for (int value = 0; value < 48; ++value) {
            const int offset = (column[value / 3] - column[0]) * 3 + value % 3;
            uint8_t* lane = index.data() + static_cast<size_t>(k) * 6 * 64 + (value / 16) * 128;
            lane[4 * (value % 16)] = static_cast<uint8_t>(offset);           // left
            lane[64 + 4 * (value % 16)] = static_cast<uint8_t>(offset + 3);  // right
        }
    }
    keep_blocks(plan, 16, std::move(start), std::move(index));
}

// interpolate_avx2_blocks' blocks, if the neighbours of every 4 values lie within 16 bytes of
// their first pixel (every block at Ultralytics' scales 0.5 to 1.5, and at a shrink by 2).
void plan_halves(Plan& plan, int out_w) {
    const int blocks = out_w / 8;
    std::vector<size_t> start(static_cast<size_t>(blocks) * 6);
    std::vector<uint8_t> index(static_cast<size_t>(blocks) * 192, 0x80);  // 0x80: a zero byte
    for (int k = 0; k < blocks; ++k) {
        for (int half = 0; half < 6; ++half) {
            const int first = 24 * k + 4 * half;
            const int origin = plan.column[first / 3] * 3;
            start[6 * static_cast<size_t>(k) + half] = static_cast<size_t>(origin);
            uint8_t* left = index.data() + static_cast<size_t>(k) * 192 + (half / 2) * 64 +
                            (half % 2) * 16;
            for (int i = 0; i < 4; ++i) {
                const int value = first + i;
                const int offset = plan.column[value / 3] * 3 + value % 3 - origin;
                // Columns run backwards under a mirroring matrix: those rows are not planned.
                if (offset < 0 || offset + 3 >= 16) return;
                left[4 * i] = static_cast<uint8_t>(offset);
                left[32 + 4 * i] = static_cast<uint8_t>(offset + 3);
            }
        }
    }
    keep_blocks(plan, 8, std::move(start), std::move(index));
}

#if defined(__x86_64__) || defined(__i386__)
// Output columns x.. of a row, one pixel at a time in a 128-bit vector: the 4 bytes at the
// left neighbour and the 4 at the right one hold their B, G, R (lanes 0-2), and lanes 0-2 of
// fma(a, right - left, left) are the three outputs (lane 3 spills into the next pixel's place,
// which it then overwrites; `out` has one float of slack at its end). 128-bit operations
// throughout: a core that splits 256-bit ones in two (Zen 1) took a fifth longer per warp
// with both neighbours in one 256-bit register and a cross-lane permute to align them.
FASTFEED_AVX2_FMA int interpolate_avx2(const uint8_t* line, const Plan& plan, float* out,
                                         int from, int out_w) {
    for (int x = from; x < out_w; ++x) {
        const uint8_t* p = line + static_cast<size_t>(plan.column[x]) * 3;
        int32_t left_bytes, right_bytes;
        std::memcpy(&left_bytes, p, 4);
        std::memcpy(&right_bytes, p + 3, 4);
        const __m128 left = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(left_bytes)));
        const __m128 right = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(right_bytes)));
        const __m128 v = _mm_fmadd_ps(_mm_set1_ps(plan.alpha[x]), _mm_sub_ps(right, left), left);
        _mm_storeu_ps(out + 3 * x, v);
    }
    return out_w;
}

// The same arithmetic, eight output pixels at a time (see plan_halves): each 128-bit lane
// holds the 16 bytes from the left neighbour of its first pixel, and one byte shuffle per lane
// picks the four left (or right) neighbour bytes of its four values into 32-bit lanes.
FASTFEED_AVX2_FMA int interpolate_avx2_blocks(const uint8_t* line, const Plan& plan, float* out) {
    const int blocks = static_cast<int>(plan.block_start.size() / 6);
    for (int k = 0; k < blocks; ++k) {
        const size_t* start = plan.block_start.data() + static_cast<size_t>(k) * 6;
        const uint8_t* index = plan.block_index.data() + static_cast<size_t>(k) * 192;
        const float* alpha = plan.alpha3.data() + static_cast<size_t>(k) * 24;
        for (int part = 0; part < 3; ++part) {
            const __m256i window = _mm256_inserti128_si256(
                _mm256_castsi128_si256(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + start[2 * part]))),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + start[2 * part + 1])), 1);
            const __m256i* at = reinterpret_cast<const __m256i*>(index + part * 64);
            const __m256 left = _mm256_cvtepi32_ps(
                _mm256_shuffle_epi8(window, _mm256_loadu_si256(at)));
            const __m256 right = _mm256_cvtepi32_ps(
                _mm256_shuffle_epi8(window, _mm256_loadu_si256(at + 1)));
            _mm256_storeu_ps(out + static_cast<size_t>(k) * 24 + 8 * part,
                             _mm256_fmadd_ps(_mm256_loadu_ps(alpha + 8 * part),
                                             _mm256_sub_ps(right, left), left));
        }
    }
    return 8 * blocks;
}

// The same arithmetic, sixteen output pixels at a time, where a block's two neighbours of each
// pixel lie within 128 bytes of its first (every block, at Ultralytics' scales 0.5 to 1.5):
// byte permutes across two registers of the row pick each of the 48 left and 48 right bytes
// into a 32-bit lane of its own, and the block's 48 outputs are computed in row order, so
// every vector operation is a full one and only six permutes touch the shuffle port.
FASTFEED_AVX512_VBMI int interpolate_vbmi(const uint8_t* line, const Plan& plan, float* out) {
    constexpr __mmask64 kLowBytes = 0x1111111111111111ULL;
    const int blocks = static_cast<int>(plan.block_start.size());
    for (int k = 0; k < blocks; ++k) {
        const uint8_t* window = line + plan.block_start[k];
        const __m512i lo = _mm512_loadu_si512(window);
        const __m512i hi = _mm512_loadu_si512(window + 64);
        const uint8_t* index = plan.block_index.data() + static_cast<size_t>(k) * 6 * 64;
        const float* alpha = plan.alpha3.data() + static_cast<size_t>(k) * 48;
        float* dst = out + static_cast<size_t>(k) * 48;
        for (int part = 0; part < 3; ++part) {
            const uint8_t* at = index + part * 128;
            const __m512 left = _mm512_cvtepi32_ps(_mm512_maskz_permutex2var_epi8(
                kLowBytes, lo, _mm512_loadu_si512(at), hi));
            const __m512 right = _mm512_cvtepi32_ps(_mm512_maskz_permutex2var_epi8(
                kLowBytes, lo, _mm512_loadu_si512(at + 64), hi));
            _mm512_storeu_ps(dst + 16 * part,
                             _mm512_fmadd_ps(_mm512_loadu_ps(alpha + 16 * part),
                                             _mm512_sub_ps(right, left), left));
        }
    }
    return 16 * blocks;
}

// Output bytes i.. of a row from its upper and lower interpolated rows, 32 at a time, as the
// scalar loop: round half to even, then the two saturating packs clamp to 0..255; they
// interleave the 128-bit lanes, which one permute puts back in order.
FASTFEED_AVX2_FMA size_t blend_rows_avx2(const float* v0, const float* v1, float b,
                                           uint8_t* out, size_t n) {
    const __m256 weight = _mm256_set1_ps(b);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i rounded[4];
        for (int j = 0; j < 4; ++j) {
            const __m256 upper = _mm256_loadu_ps(v0 + i + 8 * j);
            rounded[j] = _mm256_cvtps_epi32(_mm256_fmadd_ps(
                weight, _mm256_sub_ps(_mm256_loadu_ps(v1 + i + 8 * j), upper), upper));
        }
        const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(rounded[0], rounded[1]),
                                                  _mm256_packs_epi32(rounded[2], rounded[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                            _mm256_permutevar8x32_epi32(bytes, order));
    }
    return i;
}

// Output bytes i.. of a row from its upper and lower interpolated rows, 16 at a time, as the
// scalar loop: round half to even (the default rounding mode), then clamp to 0..255.
FASTFEED_AVX512 size_t blend_rows_avx512(const float* v0, const float* v1, float b,
                                           uint8_t* out, size_t n) {
    const __m512 weight = _mm512_set1_ps(b);
    const __m512i zero = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 upper = _mm512_loadu_ps(v0 + i);
        const __m512 v = _mm512_fmadd_ps(weight, _mm512_sub_ps(_mm512_loadu_ps(v1 + i), upper),
                                         upper);
        const __m512i rounded = _mm512_max_epi32(_mm512_cvtps_epi32(v), zero);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtusepi32_epi8(rounded));
    }
    return i;
}
#endif

// One canvas row (or the border, outside the canvas), interpolated at every output column.
// `padded` holds a canvas row as bytes, between border pixels, with kSlack bytes after it.
FASTFEED_AVX2_FMA void horizontal(const std::vector<Tile>& tiles, bool covered, int src_h,
                                    int64_t row, const Plan& plan, uint8_t border,
                                    std::vector<uint8_t>& padded, float* __restrict out,
                                    int out_w) {
    if (row < 0 || row >= src_h) {
        std::fill(out, out + static_cast<size_t>(out_w) * 3, static_cast<float>(border));
        return;
    }
    uint8_t* base = padded.data();
    if (!covered) {  // the grey between tiles
        std::fill(base + (kPad + plan.first) * 3, base + (kPad + plan.last + 1) * 3, border);
    }
    for (const Tile& tile : tiles) {
        const int lo = std::max(plan.first, tile.x1), hi = std::min(plan.last + 1, tile.x2);
        if (row < tile.y1 || row >= tile.y2 || lo >= hi) continue;
        std::memcpy(base + (kPad + lo) * 3,
                    tile.origin + (row - tile.y1) * tile.stride + (lo - tile.x1) * 3,
                    static_cast<size_t>(hi - lo) * 3);
    }
    int x = 0;
#if defined(__x86_64__) || defined(__i386__)
    // The kernels run only where available(); 16-column blocks are planned only where the CPU
    // has AVX-512 VBMI.
    if (plan.block_pixels == 16) x = interpolate_vbmi(base, plan, out);
    if (plan.block_pixels == 8) x = interpolate_avx2_blocks(base, plan, out);
    x = interpolate_avx2(base, plan, out, x, out_w);
#endif
    for (; x < out_w; ++x) {
        const uint8_t* p = base + static_cast<size_t>(plan.column[x]) * 3;
        const float a = plan.alpha[x];
        for (int c = 0; c < 3; ++c) {
            const float left = p[c], right = p[3 + c];
            out[3 * x + c] = std::fma(a, right - left, left);
        }
    }
}

FASTFEED_AVX2_FMA void warp(const std::vector<Tile>& tiles, int src_h, int src_w,
                              uint8_t* dst, int out_h, int out_w, const Inverse& inv,
                              uint8_t border, [[maybe_unused]] bool avx512, bool vbmi) {
    Plan plan = plan_columns(inv, src_w, out_w);
    if (vbmi) {
        plan_blocks(plan, out_w);
    } else {
        plan_halves(plan, out_w);
    }
    const bool covered = tiles.size() == 1 && tiles[0].y1 <= 0 && tiles[0].x1 <= 0 &&
                         tiles[0].y2 >= src_h && tiles[0].x2 >= src_w;
    std::vector<uint8_t> padded(static_cast<size_t>(src_w + 2 * kPad) * 3 + kSlack, border);
    const size_t n = static_cast<size_t>(out_w) * 3;
    std::vector<float> upper(n + 1), lower(n + 1);  // + 1: interpolate_avx2's spill
    int64_t upper_row = INT64_MIN, lower_row = INT64_MIN;
    const float m4 = static_cast<float>(inv.m4), m5 = static_cast<float>(inv.m5);
    for (int y = 0; y < out_h; ++y) {
        float sy = static_cast<float>(y) * m4;
        sy = sy + m5;
        const float top = std::floor(sy);
        const float b = sy - top;
        const int64_t row = static_cast<int64_t>(std::clamp(static_cast<double>(top), -2.0,
                                                            static_cast<double>(src_h) + 1));
        if (row == lower_row) {  // moving down one row: the old lower row is the new upper
            std::swap(upper, lower);
            upper_row = lower_row;
            lower_row = INT64_MIN;
        }
        if (row != upper_row) {
            horizontal(tiles, covered, src_h, row, plan, border, padded, upper.data(), out_w);
            upper_row = row;
        }
        if (row + 1 != lower_row) {
            horizontal(tiles, covered, src_h, row + 1, plan, border, padded, lower.data(), out_w);
            lower_row = row + 1;
        }
        uint8_t* out = dst + static_cast<size_t>(y) * n;
        const float* v0 = upper.data();
        const float* v1 = lower.data();
        size_t i = 0;
#if defined(__x86_64__) || defined(__i386__)
        i = avx512 ? blend_rows_avx512(v0, v1, b, out, n)
                   : blend_rows_avx2(v0, v1, b, out, n);
#endif
        for (; i < n; ++i) {  // an int clamp: GCC vectorises it, not a float one
            const int v = static_cast<int>(std::nearbyint(std::fma(b, v1[i] - v0[i], v0[i])));
            out[i] = static_cast<uint8_t>(std::clamp(v, 0, 255));
        }
    }
}

// Pointers arrive as integers; fastfeed/ultralytics/warp.py checks shapes, dtypes and strides.
// A tile is (origin address, row stride, y1, y2, x1, x2), as Tile.
using TileArgs = std::tuple<uintptr_t, int64_t, int, int, int, int>;

void warp_axis_aligned(const std::vector<TileArgs>& tile_args, int src_h, int src_w,
                       uintptr_t dst, int out_h, int out_w, double a, double b, double d,
                       double e, int border) {
    std::vector<Tile> tiles;
    for (const auto& [origin, stride, y1, y2, x1, x2] : tile_args) {
        tiles.push_back({reinterpret_cast<const uint8_t*>(origin), stride, y1, y2, x1, x2});
    }
    const Inverse inv = invert(a, b, d, e);
    py::gil_scoped_release release;
    warp(tiles, src_h, src_w, reinterpret_cast<uint8_t*>(dst), out_h, out_w, inv,
         static_cast<uint8_t>(border), has_avx512(), has_avx512_vbmi());
}

}  // namespace

PYBIND11_MODULE(_warp, m) {
    m.doc() = "OpenCV's bilinear warpAffine for scale-and-translate matrices, separably.";
    m.def("available", &has_avx2_fma, "Whether this CPU runs the kernel at full speed (FMA).");
    m.def("warp_axis_aligned", &warp_axis_aligned, py::arg("tiles"), py::arg("src_h"),
          py::arg("src_w"), py::arg("dst"), py::arg("out_h"), py::arg("out_w"), py::arg("a"),
          py::arg("b"), py::arg("d"), py::arg("e"), py::arg("border"),
          "Warp an src_h x src_w x 3 uint8 canvas by [[a, 0, b], [0, d, e]] into a contiguous "
          "out_h x out_w x 3 buffer, as cv2.warpAffine with INTER_LINEAR and a constant "
          "border. The canvas is the border value under tiles of HxWx3 images, each "
          "(address of its pixel (0, 0), row stride, y1, y2, x1, x2): canvas rows [y1, y2) "
          "and columns [x1, x2); later tiles cover earlier ones.");
}
