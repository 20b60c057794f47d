// The GGUF block GEMV of linear_kernel=gguf-gemv on the CPU (gguf_blocks.py builds and loads it).
//
// out [R, N] = x [R, K] (float32, R = 1..4) @ W [N, K]^T, W given by its GGUF blocks of 32 elements:
//   Q4_1: qs [N, K/32, 16] uint8 nibbles (low nibble of byte j = element j, high = element j + 16),
//         d, m [N, K/32] float16: w = d * q + m
//   Q4_0: the same without m:     w = d * (q - 8)
//   Q8_0: qs [N, K/32, 32] int8:  w = q * d
// Every w is exact in float32 (gguf's own formulas; gguf_blocks.attach checks them against the model's weights).
//
// The bits are fixed by one summation order, whatever the instruction set this file is built for (AVX-512,
// AVX2 or none): lanes of 16 floats, products and sums in that order, each rounded (built without FMA
// contraction), and one reduction tree:
//   Q4: acc[16] += w_lo * x_lo + w_hi * x_hi, block after block (elements j and j + 16 of a block in lane j)
//   Q8: acc[32] += w * x, block after block; then acc[i] + acc[i + 16]
//   then s[i] = a[i] + a[i + 8], s[i] + s[i + 4], s[i] + s[i + 2], s[0] + s[1]
// It is the order of the loop Inductor builds for gguf_blocks' torch formulas with AVX-512 (tests compare them),
// where each output is one thread's (Inductor splits a long reduction over threads when there are fewer outputs
// than threads: N = 1 or 2 with K in the thousands; no projection of a model).
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) {  // exact for every half, subnormals included
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
        float value = static_cast<float>(mantissa) * 5.9604644775390625e-08f;  // mantissa * 2^-24: exact
        std::memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}
#endif

// Sixteen float lanes: one AVX-512 register, two AVX2 registers, or an array.
#if defined(__AVX512F__)
struct V16 {
    __m512 v;
};
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 splat(float a) { return {_mm512_set1_ps(a)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 from_bytes(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))}; }
inline V16 from_signed_bytes(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))}; }
#elif defined(__AVX2__)
struct V16 {
    __m256 lo, hi;
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 splat(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 from_bytes(__m128i q) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
}
inline V16 from_signed_bytes(__m128i q) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
#else
struct V16 {
    float v[16];
};
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
inline __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(15)); }
inline __m128i high_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15)); }
inline V16 nibbles_low(const uint8_t* p) { return from_bytes(low_nibbles(load_bytes(p))); }
inline V16 nibbles_high(const uint8_t* p) { return from_bytes(high_nibbles(load_bytes(p))); }
inline V16 signed_bytes(const int8_t* p) {
    return from_signed_bytes(load_bytes(reinterpret_cast<const uint8_t*>(p)));
}
#else
inline V16 splat(float a) { V16 r; for (int i = 0; i < 16; i++) r.v[i] = a; return r; }
inline V16 load(const float* p) { V16 r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void store(float* p, V16 a) { std::memcpy(p, a.v, sizeof a.v); }
inline V16 add(V16 a, V16 b) { for (int i = 0; i < 16; i++) a.v[i] += b.v[i]; return a; }
inline V16 mul(V16 a, V16 b) { for (int i = 0; i < 16; i++) a.v[i] *= b.v[i]; return a; }
inline V16 nibbles_low(const uint8_t* p) {
    V16 r;
    for (int i = 0; i < 16; i++) r.v[i] = static_cast<float>(p[i] & 15);
    return r;
}
inline V16 nibbles_high(const uint8_t* p) {
    V16 r;
    for (int i = 0; i < 16; i++) r.v[i] = static_cast<float>(p[i] >> 4);
    return r;
}
inline V16 signed_bytes(const int8_t* p) {
    V16 r;
    for (int i = 0; i < 16; i++) r.v[i] = static_cast<float>(p[i]);
    return r;
}
inline V16 zero() { return splat(0.0f); }
#endif

inline float reduce16(V16 a) {  // the tree of the header
    float s[16];
    store(s, a);
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) s[i] = s[i] + s[i + width];
    return s[0];
}

constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead in a row's blocks the next cache lines are asked for

// One output n of a Q4_0 (m null) or Q4_1 weight for ROWS rows of x: q [K/32, 16], d, m [K/32].
template <int ROWS>
inline void q4_output(const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t blocks,
                      int64_t K, int64_t N, float* out) {
    V16 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = zero();
    for (int64_t b = 0; b < blocks; b++, q += 16) {
        __builtin_prefetch(q + PREFETCH_BYTES);
        const V16 scale = splat(half_to_float(d[b]));
        V16 lo = nibbles_low(q), hi = nibbles_high(q);
        if (m) {  // Q4_1: d * q + m
            const V16 offset = splat(half_to_float(m[b]));
            lo = add(mul(scale, lo), offset);
            hi = add(mul(scale, hi), offset);
        } else {  // Q4_0: d * (q - 8)
            lo = mul(scale, add(lo, splat(-8.0f)));
            hi = mul(scale, add(hi, splat(-8.0f)));
        }
        for (int r = 0; r < ROWS; r++) {
            const float* xb = x + r * K + b * 32;
            acc[r] = add(acc[r], add(mul(lo, load(xb)), mul(hi, load(xb + 16))));
        }
    }
    for (int r = 0; r < ROWS; r++) out[r * N] = 0.0f + reduce16(acc[r]);
}

// One output n of a Q8_0 weight for ROWS rows of x: q [K/32, 32], d [K/32].
template <int ROWS>
inline void q8_output(const float* x, const int8_t* q, const uint16_t* d, int64_t blocks, int64_t K, int64_t N,
                      float* out) {
    V16 first[ROWS], second[ROWS];
    for (int r = 0; r < ROWS; r++) first[r] = second[r] = zero();
    for (int64_t b = 0; b < blocks; b++, q += 32) {
        __builtin_prefetch(q + PREFETCH_BYTES);
        const V16 scale = splat(half_to_float(d[b]));
        const V16 w0 = mul(signed_bytes(q), scale), w1 = mul(signed_bytes(q + 16), scale);
        for (int r = 0; r < ROWS; r++) {
            const float* xb = x + r * K + b * 32;
            first[r] = add(first[r], mul(w0, load(xb)));
            second[r] = add(second[r], mul(w1, load(xb + 16)));
        }
    }
    for (int r = 0; r < ROWS; r++) out[r * N] = 0.0f + reduce16(add(first[r], second[r]));
}

template <int ROWS>
void q4_gemv(const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, float* out, int64_t N,
             int64_t K, int threads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        q4_output<ROWS>(x, qs + n * blocks * 16, d + n * blocks, m ? m + n * blocks : nullptr, blocks, K, N, out + n);
}

template <int ROWS>
void q8_gemv(const float* x, const int8_t* qs, const uint16_t* d, float* out, int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) q8_output<ROWS>(x, qs + n * blocks * 32, d + n * blocks, blocks, K, N, out + n);
}

}  // namespace

extern "C" {

// Q4_0 (m null) or Q4_1, on `threads` OpenMP threads (each output is one thread's: the bits do not depend on
// how many). Returns 0, or 1 for a row count outside 1..4 (nothing written).
int gguf_gemv_q4(const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, float* out, int64_t R,
                 int64_t N, int64_t K, int threads) {
    switch (R) {
        case 1: q4_gemv<1>(x, qs, d, m, out, N, K, threads); return 0;
        case 2: q4_gemv<2>(x, qs, d, m, out, N, K, threads); return 0;
        case 3: q4_gemv<3>(x, qs, d, m, out, N, K, threads); return 0;
        case 4: q4_gemv<4>(x, qs, d, m, out, N, K, threads); return 0;
        default: return 1;
    }
}

int gguf_gemv_q8(const float* x, const int8_t* qs, const uint16_t* d, float* out, int64_t R, int64_t N, int64_t K,
                 int threads) {
    switch (R) {
        case 1: q8_gemv<1>(x, qs, d, out, N, K, threads); return 0;
        case 2: q8_gemv<2>(x, qs, d, out, N, K, threads); return 0;
        case 3: q8_gemv<3>(x, qs, d, out, N, K, threads); return 0;
        case 4: q8_gemv<4>(x, qs, d, out, N, K, threads); return 0;
        default: return 1;
    }
}

}  // extern "C"
