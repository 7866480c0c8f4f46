// fastfeed._gather: the hot copy of the ring path.
//
// Workers gather the samples of a batch straight into a shared-memory slot. The copies run
// with the GIL released and, when a batch is large, on several threads. The module links to
// nothing but the C++ runtime: no torch and no CUDA, so that it builds and imports anywhere.
// Pointers arrive as integers; the Python wrapper (fastfeed/_stack.py) checks sizes, dtypes and
// contiguity and keeps the sources alive for the duration of the call.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <tuple>
#include <vector>

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

// Copies sources[i] (nbytes each) to dst + i * nbytes.
void gather(uintptr_t dst, const std::vector<uintptr_t>& sources, size_t nbytes, int threads) {
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
    py::gil_scoped_release release;
    parallel_ranges(jobs.size(), nthreads, [&jobs](size_t begin, size_t end) {
        for (size_t j = begin; j < end; ++j) std::memcpy(jobs[j].dst, jobs[j].src, jobs[j].nbytes);
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
          py::arg("threads") = 0,
          "Copy each source (nbytes each) to dst + i * nbytes. threads=0 picks by size.");
    m.def("gather_hwc_to_chw", &gather_hwc_to_chw, py::arg("dst"), py::arg("sources"),
          py::arg("height"), py::arg("width"), py::arg("channels"), py::arg("threads") = 0,
          "Gather uint8 HWC images, each (address, row, column and channel strides in bytes), "
          "into a uint8 NCHW batch at dst.");
}
