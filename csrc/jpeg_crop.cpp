// fastfeed._jpeg: decode only the crop window of a JPEG: the random-resized-crop box, at the
// coarsest DCT scale that still covers the requested output size.
//
// libjpeg-turbo's jpeg_crop_scanline limits decoding to the columns of the window (rounded out
// to iMCU boundaries) and jpeg_skip_scanlines skips the rows above it; rows below it are never
// read. DCT scaling (1/2, 1/4, 1/8) cuts the work again when the window is much larger than
// the output. Together this decodes a fraction of the pixels a whole-image decode touches.
//
// libjpeg reports errors by longjmp. All libjpeg calls therefore live in plain functions
// whose frames hold no C++ objects with destructors, and run with the GIL released; Python
// objects are only built after they return.
//
// The library must be the one the headers describe: their structs differ between libjpeg
// versions (6.2, 7, 8). jpeg_CreateDecompress compares the caller's JPEG_LIB_VERSION and struct
// size with its own and refuses a mismatch through the error manager, so the jump target is
// set before that first call (set after it, a refusal jumps nowhere: a crash). library()
// makes that call once, at import, for fastfeed.vision.libjpeg to refuse the module. Built
// with FASTFEED_JPEG_STATIC, the libjpeg-turbo whose headers were compiled is linked in.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <jpeglib.h>
#include <jerror.h>

namespace py = pybind11;

#ifdef FASTFEED_JPEG_STATIC
// The static libjpeg.a of a distribution is built for executables: its one reference to
// libc's data, jerror.c's stderr, cannot be relocated in a shared object. setup.py links a
// copy whose reference is renamed to this pointer.
extern "C" __attribute__((visibility("hidden"))) FILE* fastfeed_jpeg_stderr;
FILE* fastfeed_jpeg_stderr = stderr;
#endif

namespace {

#define FASTFEED_STR2(x) #x
#define FASTFEED_STR(x) FASTFEED_STR2(x)

struct ErrorManager {
    jpeg_error_mgr base;
    std::jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

void on_error(j_common_ptr cinfo) {
    auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
    (*cinfo->err->format_message)(cinfo, err->message);
    std::longjmp(err->jump, 1);
}

void on_message(j_common_ptr cinfo, int level) {
    // A truncated file is a warning to libjpeg (it pads with grey); to us it is an error,
    // as it is to Pillow.
    if (level == -1 && cinfo->err->msg_code == JWRN_JPEG_EOF) on_error(cinfo);
}

struct Request {
    const unsigned char* data;
    size_t size;
    int x, y, w, h, min_w, min_h;
};

struct Window {
    std::vector<unsigned char> pixels;  // owned by the caller's frame: safe across longjmp
    std::vector<unsigned char> row;
    int width = 0, height = 0, image_width = 0, image_height = 0, denom = 1;
    char error[JMSG_LENGTH_MAX] = {0};
};

void use_error_manager(jpeg_decompress_struct& cinfo, ErrorManager& err) {
    cinfo.err = jpeg_std_error(&err.base);
    err.base.error_exit = on_error;
    err.base.emit_message = on_message;
    cinfo.mem = nullptr;  // what jpeg_destroy_decompress frees, should creation be refused
}

// Whether the library accepts the structs of the headers this module was compiled with:
// leaves libjpeg's refusal in `refused`, or an empty string.
void check_library(char (&refused)[JMSG_LENGTH_MAX]) {
    jpeg_decompress_struct cinfo;
    ErrorManager err;
    use_error_manager(cinfo, err);
    refused[0] = '\0';
    if (setjmp(err.jump)) {
        std::snprintf(refused, sizeof(refused), "%s", err.message);
        jpeg_destroy_decompress(&cinfo);
        return;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
}

// Decodes the window. Returns false with out.error set.
bool run(const Request& req, Window& out) {
    jpeg_decompress_struct cinfo;
    ErrorManager err;
    use_error_manager(cinfo, err);
    if (setjmp(err.jump)) {
        std::snprintf(out.error, sizeof(out.error), "%s", err.message);
        jpeg_destroy_decompress(&cinfo);
        return false;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, req.data, static_cast<unsigned long>(req.size));
    jpeg_read_header(&cinfo, TRUE);
    out.image_width = static_cast<int>(cinfo.image_width);
    out.image_height = static_cast<int>(cinfo.image_height);
    if (req.w <= 0 || req.h <= 0 || req.x < 0 || req.y < 0 || req.x + req.w > out.image_width ||
        req.y + req.h > out.image_height) {
        std::snprintf(out.error, sizeof(out.error), "crop box (%d, %d, %d, %d) is outside the "
                      "%dx%d image", req.x, req.y, req.w, req.h, out.image_width,
                      out.image_height);
        jpeg_destroy_decompress(&cinfo);
        return false;
    }
    out.denom = 1;
    for (int candidate : {8, 4, 2}) {
        if (req.w / candidate >= req.min_w && req.h / candidate >= req.min_h) {
            out.denom = candidate;
            break;
        }
    }
    const int d = out.denom;
    cinfo.scale_num = 1;
    cinfo.scale_denom = d;
    cinfo.out_color_space = JCS_RGB;
    jpeg_start_decompress(&cinfo);
    const int scaled_w = static_cast<int>(cinfo.output_width);
    const int scaled_h = static_cast<int>(cinfo.output_height);
    // The window in scaled pixels.
    const int sx = std::min(scaled_w - 1, req.x / d);
    const int sy = std::min(scaled_h - 1, req.y / d);
    const int sw = std::max(1, std::min(scaled_w - sx, (req.x + req.w + d - 1) / d - sx));
    const int sh = std::max(1, std::min(scaled_h - sy, (req.y + req.h + d - 1) / d - sy));
    JDIMENSION xoff = static_cast<JDIMENSION>(sx), cropped = static_cast<JDIMENSION>(sw);
    jpeg_crop_scanline(&cinfo, &xoff, &cropped);  // widens to iMCU boundaries
    out.width = sw;
    out.height = sh;
    out.pixels.resize(static_cast<size_t>(sw) * sh * 3);
    out.row.resize(static_cast<size_t>(cropped) * 3);
    if (sy > 0) jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(sy));
    for (int r = 0; r < sh; ++r) {
        JSAMPROW rows[1] = {out.row.data()};
        jpeg_read_scanlines(&cinfo, rows, 1);
        std::memcpy(out.pixels.data() + static_cast<size_t>(r) * sw * 3,
                    out.row.data() + static_cast<size_t>(sx - static_cast<int>(xoff)) * 3,
                    static_cast<size_t>(sw) * 3);
    }
    jpeg_abort_decompress(&cinfo);  // the rows below the window are never decoded
    jpeg_destroy_decompress(&cinfo);
    return true;
}

Window run_without_gil(const std::string& data, Request req) {
    req.data = reinterpret_cast<const unsigned char*>(data.data());
    req.size = data.size();
    Window out;
    bool ok;
    {
        py::gil_scoped_release release;
        ok = run(req, out);
    }
    if (!ok) throw std::runtime_error(out.error);
    return out;
}

py::tuple decode_crop(const py::bytes& data, int x, int y, int w, int h, int min_w, int min_h) {
    Window out = run_without_gil(data, Request{nullptr, 0, x, y, w, h, min_w, min_h});
    py::array_t<uint8_t> pixels({out.height, out.width, 3});
    std::memcpy(pixels.mutable_data(), out.pixels.data(), out.pixels.size());
    return py::make_tuple(pixels, out.denom);
}

py::dict library() {
    char refused[JMSG_LENGTH_MAX];
    check_library(refused);
    py::dict out;
    out["headers"] = JPEG_LIB_VERSION;  // the libjpeg API this module was compiled for
#ifdef LIBJPEG_TURBO_VERSION
    out["turbo"] = FASTFEED_STR(LIBJPEG_TURBO_VERSION);
#else
    out["turbo"] = "";
#endif
#ifdef FASTFEED_JPEG_STATIC
    out["linked"] = "static";
#else
    out["linked"] = "shared";
#endif
    out["refused"] = std::string(refused);
    return out;
}

}  // namespace

PYBIND11_MODULE(_jpeg, m) {
    m.doc() = "Region-of-interest JPEG decoding with libjpeg-turbo.";
    m.def("decode_crop", &decode_crop, py::arg("data"), py::arg("x"), py::arg("y"), py::arg("w"),
          py::arg("h"), py::arg("min_w"), py::arg("min_h"),
          "Decode the (x, y, w, h) window of a JPEG at the coarsest DCT scale keeping it at "
          "least min_w x min_h; returns (uint8 HxWx3 array, scale_denom).");
    m.def("library", &library,
          "The libjpeg this module runs against: {'headers': the JPEG_LIB_VERSION it was "
          "compiled for, 'turbo': the libjpeg-turbo version of those headers, 'linked': "
          "'static' or 'shared', 'refused': libjpeg's refusal of this build's structs, or "
          "''}.");
}
