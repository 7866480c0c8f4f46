// fastfeed._flags: release and acquire on a flag in memory that several processes map.
//
// fastfeed.ultralytics.shared_cache publishes an image in a shared file by writing its pixels,
// then its flag. A reader in another process that sees the flag must see the pixels: on x86
// plain stores and loads keep that order, on Arm they do not, so the flag is written with
// release and read with acquire semantics.

#include <pybind11/pybind11.h>

#include <cstdint>

namespace {

void publish(uintptr_t flag, int64_t value) {
    __atomic_store_n(reinterpret_cast<int64_t*>(flag), value, __ATOMIC_RELEASE);
}

int64_t load(uintptr_t flag) {
    return __atomic_load_n(reinterpret_cast<const int64_t*>(flag), __ATOMIC_ACQUIRE);
}

}  // namespace

PYBIND11_MODULE(_flags, m) {
    m.doc() = "Release stores and acquire loads of 8-byte flags in shared memory.";
    m.def("publish", &publish, pybind11::arg("flag"), pybind11::arg("value"),
          "Store `value` at the aligned address `flag`; earlier writes become visible first.");
    m.def("load", &load, pybind11::arg("flag"),
          "Load the value at the aligned address `flag`; later reads see what preceded its store.");
}
