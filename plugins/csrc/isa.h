// The CPU features llmc's C++ kernels choose their code paths by, asked in one place.
//
// The extensions are built for the x86-64-v2 baseline (setup.py); each kernel compiles its faster loops with
// target attributes and picks one at run time from these checks. Every check calls __builtin_cpu_init first:
// the op library's globals ask for the best path while the library is being loaded, possibly before libgcc's
// own constructor has filled in the CPU model. After that a check is a load and a bit test, cheap enough to
// call per kernel call.

#pragma once

namespace llmc::cpu {

// AVX2 with FMA: the 8-float loops of every kernel.
inline bool has_avx2_fma() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// AVX-512 Foundation, on a CPU that also has AVX2 and FMA (the 16-float loops mix in AVX2 code for their tails;
// every AVX-512 CPU has both).
inline bool has_avx512f() { return has_avx2_fma() && __builtin_cpu_supports("avx512f"); }

// AVX-512 F, VL, BW and DQ: the LoRA loops, whose 16-float vectors GCC lowers with all four.
inline bool has_avx512_fvlbwdq() {
    return has_avx512f() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq");
}

// AVX-512 VNNI with F and BW: vpdpbusd on 512-bit byte vectors (Int4MatMul's integer dot products).
inline bool has_avx512_vnni() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

// AVX-512 VNNI and VBMI (vpermb): Mxfp4MoEMatMulQ8's code lookup and dot products.
inline bool has_avx512_vnni_vbmi() { return has_avx512_vnni() && __builtin_cpu_supports("avx512vbmi"); }

// F16C: float16 <-> float32 conversions of a float16 KV cache.
inline bool has_f16c() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c");
}

// The vector width most kernels are compiled for, in order: 0 the x86-64-v2 baseline, 1 AVX2 + FMA, 2 AVX-512 F.
// The kernels' own Isa enums number their paths the same way (Int4MatMul's level 2 needs VNNI as well).
inline int vector_level() {
    if (has_avx512f()) return 2;
    return has_avx2_fma() ? 1 : 0;
}

}  // namespace llmc::cpu
