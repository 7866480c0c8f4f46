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

// Bytes past a padded row's last pixel: the vector path reads 8 bytes at each left neighbour,
// 2 more than the two pixels it needs.
constexpr size_t kSlack = 8;

#if defined(__x86_64__) || defined(__i386__)
// Output columns x.. of a row, one pixel at a time in a vector: the 8 bytes at the left
// neighbour hold both neighbours' B, G, R (lanes 0-2 and 3-5), and lanes 0-2 of
// fma(a, right - left, left) are the three outputs (lane 3 spills into the next pixel's place,
// which it then overwrites; `out` has one float of slack at its end).
FASTFEED_AVX2_FMA int interpolate_avx2(const uint8_t* line, const Plan& plan, float* out,
                                         int out_w) {
    const __m256i right = _mm256_setr_epi32(3, 4, 5, 6, 7, 7, 7, 7);
    for (int x = 0; x < out_w; ++x) {
        const __m128i bytes = _mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(line + static_cast<size_t>(plan.column[x]) * 3));
        const __m256 left = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        const __m256 diff = _mm256_sub_ps(_mm256_permutevar8x32_ps(left, right), left);
        const __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(plan.alpha[x]), diff, left);
        _mm_storeu_ps(out + 3 * x, _mm256_castps256_ps128(v));
    }
    return out_w;
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
    x = interpolate_avx2(base, plan, out, out_w);  // the kernel runs only where available()
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
                              uint8_t border) {
    const Plan plan = plan_columns(inv, src_w, out_w);
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
        for (size_t i = 0; i < n; ++i) {  // an int clamp: GCC vectorises it, not a float one
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
         static_cast<uint8_t>(border));
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
