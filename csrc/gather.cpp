// fastfeed._gather: the hot copy of the ring path.
//
// Workers gather the samples of a batch straight into a shared-memory slot. The copies run
// with the GIL released and, when a batch is large, on several threads. The module links to
// nothing but the C++ runtime: no torch and no CUDA, so that it builds and imports anywhere.
// Pointers arrive as integers; the Python wrapper (fastfeed/_stack.py) checks sizes, dtypes and
// contiguity and keeps the sources alive for the duration of the call.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace py = pybind11;

namespace {

// Below this many bytes per thread, starting a thread costs more than it saves.
constexpr size_t kMinBytesPerThread = 4u << 20;

struct CopyJob {
    uint8_t* dst;
    const uint8_t* src;
    size_t nbytes;
};

size_t choose_threads(size_t total_bytes, int requested) {
    size_t useful = std::max<size_t>(1, total_bytes / kMinBytesPerThread);
    size_t cap = requested > 0 ? static_cast<size_t>(requested)
                               : std::max(1u, std::thread::hardware_concurrency());
    return std::min(useful, cap);
}

// Runs body(begin, end) over [0, n) split into `threads` contiguous ranges.
template <typename Body>
void parallel_ranges(size_t n, size_t threads, Body body) {
    if (threads <= 1 || n <= 1) {
        body(0, n);
        return;
    }
    threads = std::min(threads, n);
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    size_t step = (n + threads - 1) / threads;
    for (size_t t = 1; t < threads; ++t) {
        size_t begin = t * step, end = std::min(n, begin + step);
        if (begin < end) pool.emplace_back(body, begin, end);
    }
    body(0, std::min(n, step));
    for (auto& th : pool) th.join();
}

// The L3 size, as Linux describes the cache of CPU 0 ("8192K"); sysconf's figure comes from
// CPUID, which in a virtual machine can describe the host's whole socket.
size_t l3_bytes() {
    if (FILE* file = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
        unsigned long kib = 0;
        const bool read = std::fscanf(file, "%luK", &kib) == 1;
        std::fclose(file);
        if (read && kib > 0) return static_cast<size_t>(kib) << 10;
    }
    long l3 = 0;
#if defined(_SC_LEVEL3_CACHE_SIZE)
    l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return l3 > 0 ? static_cast<size_t>(l3) : size_t{8} << 20;
}

// A batch is one copy of its total size, made in sample-sized memcpy calls. memcpy itself
// switches to non-temporal stores for a single copy larger than about 3/4 of the shared cache
// (glibc's threshold): the destination would not stay in the cache anyway, and ordinary stores
// first read every destination line from memory (a third more traffic for a copy). Its calls
// here are a sample each, far below that, so the choice is made for the batch as a whole, at
// the same threshold.
size_t default_streaming_threshold() { return l3_bytes() / 4 * 3; }

// memcpy with non-temporal stores: 16-byte aligned streaming stores, 64 bytes (a cache line)
// at a time. The caller fences (sfence) before anyone else may read the destination.
void copy_streaming(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
    size_t head = std::min(n, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const auto* from = reinterpret_cast<const __m128i*>(src + i);
        auto* to = reinterpret_cast<__m128i*>(dst + i);
        __m128i a = _mm_loadu_si128(from), b = _mm_loadu_si128(from + 1);
        __m128i c = _mm_loadu_si128(from + 2), d = _mm_loadu_si128(from + 3);
        _mm_stream_si128(to, a);
        _mm_stream_si128(to + 1, b);
        _mm_stream_si128(to + 2, c);
        _mm_stream_si128(to + 3, d);
    }
    std::memcpy(dst + i, src + i, n - i);
#else
    std::memcpy(dst, src, n);
#endif
}

void fence_streaming_stores() {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

// Copies sources[i] (nbytes each) to dst + i * nbytes; with non-temporal stores where the
// batch is larger than streaming_above bytes.
void gather(uintptr_t dst, const std::vector<uintptr_t>& sources, size_t nbytes, int threads,
            size_t streaming_above) {
    // Split every sample into chunks so that a batch of a few huge samples still spreads.
    const size_t total = nbytes * sources.size();
    const size_t nthreads = choose_threads(total, threads);
    const size_t chunk = nthreads > 1 ? std::max<size_t>(1u << 20, total / (nthreads * 4)) : nbytes;
    std::vector<CopyJob> jobs;
    jobs.reserve(sources.size() * (nbytes / std::max<size_t>(chunk, 1) + 1));
    auto* out = reinterpret_cast<uint8_t*>(dst);
    for (size_t i = 0; i < sources.size(); ++i) {
        auto* src = reinterpret_cast<const uint8_t*>(sources[i]);
        for (size_t off = 0; off < nbytes; off += chunk) {
            jobs.push_back({out + i * nbytes + off, src + off, std::min(chunk, nbytes - off)});
        }
    }
    const bool streaming = total > streaming_above;
    py::gil_scoped_release release;
    parallel_ranges(jobs.size(), nthreads, [&jobs, streaming](size_t begin, size_t end) {
        if (!streaming) {
            for (size_t j = begin; j < end; ++j) std::memcpy(jobs[j].dst, jobs[j].src, jobs[j].nbytes);
            return;
        }
        for (size_t j = begin; j < end; ++j) copy_streaming(jobs[j].dst, jobs[j].src, jobs[j].nbytes);
        fence_streaming_stores();  // on this thread, before the batch is handed over
    });
}

// n uint8 pixels, `stride` bytes apart, mapped through a 256-entry table into floats; with
// non-temporal stores (16-byte aligned, four floats at a time) when streaming.
void map_pixels(float* dst, const uint8_t* src, size_t n, int64_t stride, const float* table,
                bool streaming) {
    auto at = [src, stride](size_t i) { return src[static_cast<int64_t>(i) * stride]; };
    size_t i = 0;
#if defined(__SSE2__)
    if (streaming) {
        for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 15) != 0; ++i) dst[i] = table[at(i)];
        for (; i + 4 <= n; i += 4) {
            _mm_stream_ps(dst + i, _mm_setr_ps(table[at(i)], table[at(i + 1)],
                                               table[at(i + 2)], table[at(i + 3)]));
        }
    }
#endif
    for (; i < n; ++i) dst[i] = table[at(i)];
}

// Gathers uint8 C×H×W samples into a float32 NCHW batch at dst, each byte of channel c mapped
// through tables[c] (256 floats each): a per-channel elementwise tail (to float, Normalize),
// tabulated by the caller with the very ops it replaces, in the same pass as the gather.
// The samples share their strides (in bytes): contiguous planes are mapped whole; other
// layouts (channels-last: H×W×C memory, as a resize writes it) row by row, transposed as
// they are read.
void gather_through_tables(uintptr_t dst, const std::vector<uintptr_t>& sources,
                           size_t channels, size_t height, size_t width,
                           int64_t channel_stride, int64_t row_stride, int64_t column_stride,
                           uintptr_t tables, int threads, size_t streaming_above) {
    const size_t plane = height * width;
    const size_t total = sources.size() * channels * plane * sizeof(float);
    const bool streaming = total > streaming_above;
    const bool planes = column_stride == 1 && row_stride == static_cast<int64_t>(width) &&
                        channel_stride == static_cast<int64_t>(plane);
    const size_t nthreads = choose_threads(total, threads);
    const auto* table = reinterpret_cast<const float*>(tables);
    auto* out = reinterpret_cast<float*>(dst);
    py::gil_scoped_release release;
    // Work items: a sample's channel plane, or a sample's row.
    const size_t rows = planes ? 1 : height;
    parallel_ranges(sources.size() * rows, nthreads, [&](size_t begin, size_t end) {
        for (size_t r = begin; r < end; ++r) {
            const size_t n = r / rows, y = r % rows;
            const auto* row = reinterpret_cast<const uint8_t*>(sources[n]) +
                              static_cast<int64_t>(y) * row_stride;
            for (size_t c = 0; c < channels; ++c) {
                const auto* src = row + static_cast<int64_t>(c) * channel_stride;
                float* to = out + (n * channels + c) * plane + y * width;
                map_pixels(to, src, planes ? plane : width, column_stride, table + 256 * c,
                           streaming);
            }
        }
        if (streaming) fence_streaming_stores();
    });
}

// A uint8 image as (address of pixel (0, 0) channel 0, row, column and channel strides in
// bytes). Strides may be negative: a mirrored view, or channels read in reverse (BGR as RGB).
using StridedImage = std::tuple<uintptr_t, int64_t, int64_t, int64_t>;

// Gathers uint8 HWC images into a uint8 NCHW batch, transposing in the same pass.
void gather_hwc_to_chw(uintptr_t dst, const std::vector<StridedImage>& sources, size_t height,
                       size_t width, size_t channels, int threads) {
    const size_t plane = height * width;
    const size_t image = plane * channels;
    const size_t rows = sources.size() * height;
    const size_t nthreads = choose_threads(image * sources.size(), threads);
    auto* out = reinterpret_cast<uint8_t*>(dst);
    py::gil_scoped_release release;
    parallel_ranges(rows, nthreads, [&](size_t begin, size_t end) {
        for (size_t r = begin; r < end; ++r) {
            const size_t n = r / height, y = r % height;
            const auto& [base, row_stride, col_stride, channel_stride] = sources[n];
            const auto* row = reinterpret_cast<const uint8_t*>(base) +
                              static_cast<int64_t>(y) * row_stride;
            uint8_t* dst_row = out + n * image + y * width;
            if (channels == 3) {  // one pass over the source row, writing the three planes
                uint8_t *d0 = dst_row, *d1 = dst_row + plane, *d2 = dst_row + 2 * plane;
                const int64_t c1 = channel_stride, c2 = 2 * channel_stride;
                for (size_t x = 0; x < width; ++x) {
                    const uint8_t* px = row + static_cast<int64_t>(x) * col_stride;
                    d0[x] = px[0];
                    d1[x] = px[c1];
                    d2[x] = px[c2];
                }
                continue;
            }
            for (size_t c = 0; c < channels; ++c) {
                uint8_t* d = dst_row + c * plane;
                const uint8_t* s = row + static_cast<int64_t>(c) * channel_stride;
                for (size_t x = 0; x < width; ++x) d[x] = s[static_cast<int64_t>(x) * col_stride];
            }
        }
    });
}

}  // namespace

PYBIND11_MODULE(_gather, m) {
    m.doc() = "fastfeed's gather kernels: copies into ring slots with the GIL released.";
    m.def("gather", &gather, py::arg("dst"), py::arg("sources"), py::arg("nbytes"),
          py::arg("threads") = 0, py::arg("streaming_above") = default_streaming_threshold(),
          "Copy each source (nbytes each) to dst + i * nbytes. threads=0 picks by size; a batch "
          "of more than streaming_above bytes is written with non-temporal stores.");
    m.def("gather_through_tables", &gather_through_tables, py::arg("dst"), py::arg("sources"),
          py::arg("channels"), py::arg("height"), py::arg("width"), py::arg("channel_stride"),
          py::arg("row_stride"), py::arg("column_stride"), py::arg("tables"),
          py::arg("threads") = 0, py::arg("streaming_above") = default_streaming_threshold(),
          "Gather uint8 C×H×W samples (sharing these strides, in bytes) into float32 NCHW at "
          "dst, each byte of channel c mapped through the 256 floats at tables + 256 * c.");
    m.def("streaming_threshold", &default_streaming_threshold,
          "Bytes above which a batch is written with non-temporal stores (3/4 of the L3).");
    m.def("gather_hwc_to_chw", &gather_hwc_to_chw, py::arg("dst"), py::arg("sources"),
          py::arg("height"), py::arg("width"), py::arg("channels"), py::arg("threads") = 0,
          "Gather uint8 HWC images, each (address, row, column and channel strides in bytes), "
          "into a uint8 NCHW batch at dst.");
}
