// The inner loops of two matmul row tiles on one core, over data in L1 (AMD Zen 5): int8 weights against x as
// two int8 parts with vpdpbusd (6 rows x 2 blocks x hi/lo: 24 int32 accumulators), and vec_gemm.h's bf16
// tile (12 rows x 2 blocks, vdpbf16ps). Both run at two products a cycle.
//   g++ -O3 -march=native -o byte_tile_mb byte_tile_mb.cpp && ./byte_tile_mb
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); return acc; }
template <int R>
__attribute__((noinline)) void byte_tile(const int8_t* parts, int64_t k, const uint8_t* q0, const uint8_t* q1, int32_t* out) {
  __m512i h[R][2], l[R][2];
  for (int r = 0; r < R; ++r) h[r][0] = h[r][1] = l[r][0] = l[r][1] = _mm512_setzero_si512();
  for (int64_t s = 0; s < k / 4; ++s) {
    const __m512i w0 = _mm512_loadu_si512(q0 + s * 64), w1 = _mm512_loadu_si512(q1 + s * 64);
    for (int r = 0; r < R; ++r) {
      const int8_t* at = parts + r * k * 2 + 8 * s;
      const __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(at));
      const __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(at + 4));
      h[r][0] = dpbusd(h[r][0], w0, xh); h[r][1] = dpbusd(h[r][1], w1, xh);
      l[r][0] = dpbusd(l[r][0], w0, xl); l[r][1] = dpbusd(l[r][1], w1, xl);
    }
  }
  for (int r = 0; r < R; ++r) for (int j = 0; j < 2; ++j) { _mm512_storeu_si512(out + (r * 4 + j) * 16, h[r][j]); _mm512_storeu_si512(out + (r * 4 + 2 + j) * 16, l[r][j]); }
}
template <int R>
__attribute__((noinline)) void bf_tile(const uint16_t* x, int64_t k, const uint16_t* b0, const uint16_t* b1, float* out) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + p * 32), w1 = (__m512bh)_mm512_loadu_si512(b1 + p * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * k + 2 * p));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0); acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) for (int j = 0; j < 2; ++j) _mm512_storeu_ps(out + (r * 2 + j) * 16, acc[r][j]);
}
int main() {
  const int64_t k = 576; const int reps = 200000;
  std::vector<int8_t> parts(12 * k * 2, 1); std::vector<uint8_t> q(2 * k * 16, 3);
  std::vector<uint16_t> x(12 * k, 0x3f80), b(2 * k * 16 * 2, 0x3f80);
  std::vector<int32_t> o(1024); std::vector<float> f(1024);
  for (int t = 0; t < 3; ++t) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) byte_tile<6>(parts.data(), k, q.data(), q.data() + k * 16, o.data());
    auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) bf_tile<12>(x.data(), k, b.data(), b.data() + k * 32, f.data());
    auto t2 = std::chrono::steady_clock::now();
    // per tile: byte 6 rows x 32 out x k MACs; bf16 12 rows
    double db = std::chrono::duration<double>(t1 - t0).count() / reps, df = std::chrono::duration<double>(t2 - t1).count() / reps;
    printf("byte 6 rows: %.1f ns (%.2f ns per row), bf16 12 rows: %.1f ns (%.2f ns per row)\n", db * 1e9, db * 1e9 / 6, df * 1e9, df * 1e9 / 12);
  }
  printf("%d %f\n", o[5], f[5]);
}
