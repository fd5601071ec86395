// Vector math shared by the kernels (AVX-512 only; include inside an __AVX512F__ guard).
#pragma once

#include <immintrin.h>

namespace {

// exp on 16 lanes: 2^t = 2^floor(t) * poly(frac(t)), with scalef doing the 2^floor(t) exactly; ~1e-7 relative.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, fi);
}

// silu(x) = x / (1 + e^-x), with 1 / (1 + e^-x) by a reciprocal estimate and one Newton step (a full
// division is ~4x slower here).
inline __m512 silu512(__m512 x) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(x, inv);
}

}  // namespace
