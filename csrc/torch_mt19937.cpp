// fastfeed._mt19937: the next 32-bit words of a torch CPU generator, drawn from the bytes of
// its state (what torch.Generator.get_state() returns) and advanced there, without torch.
//
// A torchvision transform draws its crop window with torch ops on one-element tensors, each
// microseconds of dispatch for 32 random bits. fastfeed draws the same words from a copy of
// the state and hands the advanced state back to torch. The state is the legacy layout that
// torch.Generator.get_state() returns:
//   uint64 the_initial_seed; int32 left; int32 seeded; uint64 next; uint64 state[624]; ...
// and the engine is MT19937 with torch's bookkeeping: `left` counts down to a regeneration
// that happens *before* the word is read, `next` indexes the word. fastfeed checks its draws
// against torch's own before it uses them (fastfeed/vision/accelerate/torch_draws.py).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

namespace {

constexpr int kN = 624;
constexpr int kM = 397;
constexpr uint32_t kMatrixA = 0x9908b0dfU;
constexpr uint32_t kUpperMask = 0x80000000U;
constexpr uint32_t kLowerMask = 0x7fffffffU;

struct LegacyState {
    uint64_t the_initial_seed;
    int32_t left;
    int32_t seeded;
    uint64_t next;
    uint64_t state[kN];
};
static_assert(offsetof(LegacyState, left) == 8 && offsetof(LegacyState, next) == 16 &&
              offsetof(LegacyState, state) == 24, "torch's legacy generator state layout");

uint32_t twist(uint32_t u, uint32_t v) {
    return (((u & kUpperMask) | (v & kLowerMask)) >> 1) ^ ((v & 1U) ? kMatrixA : 0U);
}

// The state words are uint32 values held in uint64 slots.
void regenerate(uint64_t* s) {
    auto at = [s](int i) { return static_cast<uint32_t>(s[i]); };
    int i = 0;
    for (; i < kN - kM; ++i) s[i] = at(i + kM) ^ twist(at(i), at(i + 1));
    for (; i < kN - 1; ++i) s[i] = at(i + kM - kN) ^ twist(at(i), at(i + 1));
    s[kN - 1] = at(kM - 1) ^ twist(at(kN - 1), at(0));
}

uint32_t temper(uint32_t y) {
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
}

std::vector<uint32_t> draw_words(uintptr_t address, size_t count) {
    auto* g = reinterpret_cast<LegacyState*>(address);
    if (!g->seeded || g->left <= 0 || g->left > kN || g->next > kN) {
        throw std::invalid_argument("not a valid torch CPU generator state");
    }
    std::vector<uint32_t> words(count);
    for (auto& word : words) {
        if (--g->left == 0) {
            regenerate(g->state);
            g->left = kN;
            g->next = 0;
        }
        word = temper(static_cast<uint32_t>(g->state[g->next++]));
    }
    return words;
}

// torch's CPU uniform_ on float32: the low 24 bits of the word scaled into [0, 1), then
// x * (to - from) + from in float; `fused` as one multiply-add, which a compiler may have
// chosen for torch's kernel (fastfeed asks torch which). This file is built with
// -ffp-contract=off so that the other form stays unfused.
// Empty where the value rounds to `to`: torch releases differ in what they return then.
std::optional<float> uniform_float(uint32_t word, double from_, double to_, bool fused) {
    const float from = static_cast<float>(from_), to = static_cast<float>(to_);
    const float x = static_cast<float>(word & 0xffffffU) * (1.0f / 16777216.0f);
    const float value = fused ? std::fma(x, to - from, from) : x * (to - from) + from;
    if (value == to) return std::nullopt;
    return value;
}

}  // namespace

PYBIND11_MODULE(_mt19937, m) {
    m.doc() = "The next 32-bit words of a torch CPU generator, from the bytes of its state.";
    m.def("draw_words", &draw_words, pybind11::arg("address"), pybind11::arg("count"),
          "The next `count` words of the generator whose legacy state (torch.Generator."
          "get_state()'s bytes) is at `address`, advancing that state in place.");
    m.def("uniform_float", &uniform_float, pybind11::arg("word"), pybind11::arg("low"),
          pybind11::arg("high"), pybind11::arg("fused"),
          "The float32 that torch's CPU uniform_(low, high) makes of `word`; None where it rounds "
          "to `high`.");
}
