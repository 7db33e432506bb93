// exp(x) for x <= 0, shared by the PagedAttention softmax and Int4MatMul's SwiGLU epilogue.
//
// Vectorisable, no libm call: Cody-Waite range reduction and the Cephes expf polynomial, about 1 ulp.
// Arguments below -87.3 (results below 1e-38, which cannot change a sum that is >= 1) are clamped so
// that 2^n stays a normal float. One template for a float and for GCC vector types (F a vector of
// floats, I the int32 vector of the same width), so every caller computes the same bits per lane.

#pragma once

#include <cstdint>
#include <type_traits>

namespace llmc {

template <typename F, typename I>
inline __attribute__((always_inline)) F exp_nonpos_t(F x) {
    x = x < -87.3f ? F{} - 87.3f : x;
    const F shifter = F{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
    const F n = (x * 1.44269504088896341f + shifter) - shifter;
    F r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const F z = r * r;
    F y = F{} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    I e;
    if constexpr (std::is_same<F, float>::value) {
        e = static_cast<int32_t>(n);
    } else {
        e = __builtin_convertvector(n, I);
    }
    e = (e + 127) << 23;
    return y * __builtin_bit_cast(F, e);
}

inline __attribute__((always_inline)) float exp_nonpos(float x) { return exp_nonpos_t<float, int32_t>(x); }

}  // namespace llmc
