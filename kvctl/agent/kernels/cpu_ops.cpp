// CPU kernels of the serving path, for x86-64 CPUs with AVX-512 (F, BW, VL, DQ).
//
// Two operations that eager PyTorch does in several passes over memory, each done here in one:
//
// paged_decode_attention: one new token per sequence attending to its cached K/V where the pages
//   lie in the pool's segments (page-major storage, [segment_pages, layers, 2, page_size,
//   kv_heads, head_dim] per segment), reading each page of the batch once, through the page
//   tables. Eager PyTorch must gather the pages into a padded buffer first (a second copy of every
//   byte of the batch's KV) and then read that buffer with SDPA. Online softmax (running max and
//   sum), float32 accumulation, grouped-query heads (query head h reads KV head h / group).
//   Gemma's two twists, both off at 0: a sliding window (the new token sees only the last
//   `window` keys; the pages wholly before them are neither read nor checked, so they can go back
//   to the pool) and logit soft-capping (each score s becomes cap * tanh(s / cap), Gemma 2); and
//   gpt-oss's attention sinks (a logit per query head in the softmax's denominator: the running
//   max and sum start from it instead of from nothing, as if it were a key whose value is zero).
//
// packed_linear: y = x @ W^T + b with W repacked once into 16-column blocks ([N/16][K][16]): two
//   adjacent blocks are read as two sequential streams, and each of their values feeds up to 14
//   rows of x from registers. At decode sizes (1 to 64 rows) this is limited by memory bandwidth, where MKL's
//   sgemm on the row-major weight is not (it reaches about half of it at 8 rows); at prefill
//   sizes it stays within about 20 % of sgemm.
//
// And the elementwise steps of a decoder layer, each one pass where eager PyTorch takes several
// operations (and, at decode sizes, several dispatches that cost more than the arithmetic):
// RMSNorm with the residual add before it, rotary embeddings applied in place to the queries and
// keys of the fused qkv product, and SwiGLU's silu(gate) * up (GeGLU's gelu_tanh(gate) * up); in
// float32 or bfloat16 (bfloat16 models' linear layers are oneDNN's, see projection.py).
//
// All parallelise with at::parallel_for (torch's own thread pool and thread count); the
// elementwise ones run on the calling thread below a few dozen rows, where a fork costs more.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>

namespace {

// ---- small vector helpers -------------------------------------------------------------------

// exp(x): Cephes' range reduction x = n ln2 + r and a degree-6 polynomial of r, then 2^n through
// the exponent bits. Relative error below 2e-7 on [-87, 88]; inputs are clamped to that range
// (below it the result is ~1e-38 instead of a denormal, above it ~1.6e38 instead of infinity).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// tanh(x): Cephes' tanhf. Below |x| = 0.625 an odd polynomial (where 1 - 2 / (e^2x + 1) would
// lose the relative accuracy of a small x), above it that formula through exp512 (whose clamp at
// 88 gives exactly 1 from |x| = 44 on). Both are computed and blended: relative error below
// 1.5e-7 (measured on [-60, 60] against double tanh).
inline __m512 tanh512(__m512 x) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 ax = _mm512_andnot_ps(sign, x);
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, x2), x, x);
  const __m512 e = exp512(_mm512_add_ps(ax, ax));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 large =
      _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(is_small, _mm512_or_ps(large, _mm512_and_ps(sign, x)), small);
}

// 16 vectors of partial sums -> one vector whose lane i is the horizontal sum of v[i]: a
// transposing reduction tree (4 levels of shuffles and adds, then one permute), about 2
// operations per result instead of the ~8 of a horizontal sum each.
inline __m512 reduce16(const __m512* v) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 lo = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44);
    const __m512 hi = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE);
    t[i] = _mm512_add_ps(lo, hi);
  }
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 lo = _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88);
    const __m512 hi = _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD);
    u[i] = _mm512_add_ps(lo, hi);
  }
  __m512 w[2];
  for (int i = 0; i < 2; ++i) {
    const __m512 lo = _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44);
    const __m512 hi = _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE);
    w[i] = _mm512_add_ps(lo, hi);
  }
  const __m512 lo = _mm512_shuffle_ps(w[0], w[1], 0x88);
  const __m512 hi = _mm512_shuffle_ps(w[0], w[1], 0xDD);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, _mm512_add_ps(lo, hi));
}

// 16 consecutive values as float32 vectors, from float32 or bfloat16 storage.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// ---- paged decode attention -----------------------------------------------------------------

struct PageGeometry {
  int64_t segment_pages;
  int64_t layers;
  int64_t page_size;
  int64_t kv_heads;
  int64_t page_elements;  // one layer's K (or V) of one page: page_size * kv_heads * head_dim
};

// One (sequence, KV head) of a decode batch: its G query heads over the tokens [start, length) of
// its pages (start > 0 under a sliding window: the pages before it are not read). G and D are
// compile-time so the queries and accumulators stay in registers (D = 256 spills, and still reads
// each page once); so is Capped, so that only soft-capped models pay for the tanh.
template <int G, int D, typename kv_t, bool Capped>
void decode_one(const kv_t* const* segments, const PageGeometry& geo, int64_t layer,
                const int32_t* table, int64_t start, int64_t length, int64_t kv_head,
                const float* q, float scale, float softcap, const float* sinks, float* out) {
  constexpr int C = D / 16;  // vectors per head
  const int64_t token_stride = geo.kv_heads * D;
  __m512 query[G][C];
  __m512 acc[G][C];
  float running_max[G];
  float running_sum[G];
  for (int h = 0; h < G; ++h) {
    for (int c = 0; c < C; ++c) {
      query[h][c] = _mm512_mul_ps(_mm512_loadu_ps(q + h * D + c * 16), _mm512_set1_ps(scale));
      acc[h][c] = _mm512_setzero_ps();
    }
    // a sink is a key of score sinks[h] and value zero: exp(sink - max) = 1 in the sum
    running_max[h] = sinks ? sinks[h] : -std::numeric_limits<float>::infinity();
    running_sum[h] = sinks ? 1.f : 0.f;
  }
  alignas(64) float weights[G][16];
  auto page_base = [&](int32_t page) {
    const int64_t row = page % geo.segment_pages;
    return segments[page / geo.segment_pages] +
           (row * geo.layers + layer) * 2 * geo.page_elements + kv_head * D;
  };
  const int64_t pages = (length + geo.page_size - 1) / geo.page_size;
  for (int64_t j = start / geo.page_size; j < pages; ++j) {
    const kv_t* keys = page_base(table[j]);
    const kv_t* values = keys + geo.page_elements;
    if (j + 1 < pages) {  // the next page's rows of this head, K and V, into L1 meanwhile
      const char* next = reinterpret_cast<const char*>(page_base(table[j + 1]));
      const int64_t row_bytes = D * sizeof(kv_t);
      const int64_t stride = token_stride * sizeof(kv_t);
      const int64_t half = geo.page_elements * sizeof(kv_t);
      for (int64_t t = 0; t < geo.page_size; ++t) {
        for (int64_t b = 0; b < row_bytes; b += 64) {
          _mm_prefetch(next + t * stride + b, _MM_HINT_T0);
          _mm_prefetch(next + half + t * stride + b, _MM_HINT_T0);
        }
      }
    }
    const int64_t in_page = std::min(geo.page_size, length - j * geo.page_size);
    // the first page read may begin before the window: its blocks start at the window's start
    for (int64_t t0 = std::max<int64_t>(0, start - j * geo.page_size); t0 < in_page; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, in_page - t0));
      const __mmask16 valid = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
      for (int h = 0; h < G; ++h) {
        __m512 partial[16];
        for (int t = 0; t < 16; ++t) {
          const kv_t* k = keys + (t0 + (t < n ? t : 0)) * token_stride;
          __m512 a = _mm512_mul_ps(query[h][0], load16(k));
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(query[h][c], load16(k + c * 16), a);
          partial[t] = a;
        }
        __m512 scores = reduce16(partial);
        if constexpr (Capped) {
          const __m512 bent = tanh512(_mm512_mul_ps(scores, _mm512_set1_ps(1.f / softcap)));
          scores = _mm512_mul_ps(bent, _mm512_set1_ps(softcap));
        }
        scores = _mm512_mask_blend_ps(
            valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scores);
        const float block_max = _mm512_reduce_max_ps(scores);
        const float new_max = std::max(block_max, running_max[h]);
        const __m512 p = _mm512_maskz_mov_ps(
            valid, exp512(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
        const float correction =
            running_max[h] == -std::numeric_limits<float>::infinity()
                ? 0.f
                : std::exp(running_max[h] - new_max);
        running_sum[h] = running_sum[h] * correction + _mm512_reduce_add_ps(p);
        running_max[h] = new_max;
        const __m512 cv = _mm512_set1_ps(correction);
        for (int c = 0; c < C; ++c) acc[h][c] = _mm512_mul_ps(acc[h][c], cv);
        _mm512_store_ps(weights[h], p);
      }
      for (int t = 0; t < n; ++t) {
        const kv_t* v = values + (t0 + t) * token_stride;
        __m512 row[C];
        for (int c = 0; c < C; ++c) row[c] = load16(v + c * 16);
        for (int h = 0; h < G; ++h) {
          const __m512 w = _mm512_set1_ps(weights[h][t]);
          for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(w, row[c], acc[h][c]);
        }
      }
    }
  }
  for (int h = 0; h < G; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / running_sum[h]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + h * D + c * 16, _mm512_mul_ps(acc[h][c], inv));
  }
}

using DecodeFn = void (*)(const void* const*, const PageGeometry&, int64_t, const int32_t*,
                          int64_t, int64_t, int64_t, const float*, float, float, const float*,
                          float*);

template <int G, int D, typename kv_t, bool Capped>
void decode_erased(const void* const* segments, const PageGeometry& geo, int64_t layer,
                   const int32_t* table, int64_t start, int64_t length, int64_t kv_head,
                   const float* q, float scale, float softcap, const float* sinks, float* out) {
  decode_one<G, D, kv_t, Capped>(reinterpret_cast<const kv_t* const*>(segments), geo, layer,
                                 table, start, length, kv_head, q, scale, softcap, sinks, out);
}

template <typename kv_t, int D, bool Capped>
DecodeFn pick_group(int64_t group) {
  switch (group) {
    case 1: return decode_erased<1, D, kv_t, Capped>;
    case 2: return decode_erased<2, D, kv_t, Capped>;
    case 3: return decode_erased<3, D, kv_t, Capped>;
    case 4: return decode_erased<4, D, kv_t, Capped>;
    case 5: return decode_erased<5, D, kv_t, Capped>;
    case 6: return decode_erased<6, D, kv_t, Capped>;
    case 7: return decode_erased<7, D, kv_t, Capped>;
    case 8: return decode_erased<8, D, kv_t, Capped>;
    default: return nullptr;
  }
}

template <typename kv_t, bool Capped>
DecodeFn pick_decode(int64_t group, int64_t head_dim) {
  switch (head_dim) {
    case 16: return pick_group<kv_t, 16, Capped>(group);
    case 32: return pick_group<kv_t, 32, Capped>(group);
    case 64: return pick_group<kv_t, 64, Capped>(group);
    case 128: return pick_group<kv_t, 128, Capped>(group);
    case 256: return pick_group<kv_t, 256, Capped>(group);  // Gemma's
    default: return nullptr;
  }
}

DecodeFn decode_for(at::ScalarType dtype, int64_t group, int64_t head_dim, bool capped) {
  if (dtype == at::kFloat)
    return capped ? pick_decode<float, true>(group, head_dim)
                  : pick_decode<float, false>(group, head_dim);
  if (dtype == at::kBFloat16)
    return capped ? pick_decode<at::BFloat16, true>(group, head_dim)
                  : pick_decode<at::BFloat16, false>(group, head_dim);
  return nullptr;
}

// Whether a layout has a kernel (with a window and soft-capping or without: the same layouts).
bool decode_supported(const std::string& dtype, int64_t group, int64_t head_dim) {
  const at::ScalarType type = dtype == "float32" ? at::kFloat
                              : dtype == "bfloat16" ? at::kBFloat16
                                                    : at::kHalf;
  return decode_for(type, group, head_dim, false) != nullptr;
}

// q [B, H, D] float32; segments: the pool's segment tensors (same dtype, float32 or bfloat16);
// tables int32 [B, P] page ids; lengths int32 [B] (tokens of each sequence, the new one
// included, all already written). window > 0: a sequence of length L attends only to its keys
// [max(0, L - window), L) (the new token sees key j iff (L - 1) - j < window, as transformers
// masks Gemma's sliding layers); table entries of the pages wholly before that are ignored (they
// may be stale: those pages can be back in the pool). softcap > 0: each scaled score s becomes
// softcap * tanh(s / softcap) before the softmax (Gemma 2's attn_logit_softcapping). 0 turns
// either off. sinks: None, or float32 [H], each query head's sink logit (gpt-oss). Returns
// [B, H, D] float32.
at::Tensor paged_decode_attention(const at::Tensor& q, const std::vector<at::Tensor>& segments,
                                  const at::Tensor& tables, const at::Tensor& lengths,
                                  int64_t layer, double scale, int64_t window, double softcap,
                                  const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [batch, heads, head_dim] tensor");
  TORCH_CHECK(!segments.empty(), "at least one segment");
  const at::Tensor& first = segments[0];
  TORCH_CHECK(first.dim() == 6, "segments are [segment_pages, layers, 2, page_size, kv_heads, d]");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.dim() == 2,
              "tables must be contiguous int32 [batch, pages]");
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.is_contiguous(),
              "lengths must be contiguous int32");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  PageGeometry geo{first.size(0), first.size(1), first.size(3), first.size(4), 0};
  geo.page_elements = geo.page_size * geo.kv_heads * head_dim;
  TORCH_CHECK(first.size(5) == head_dim && heads % geo.kv_heads == 0, "head shapes differ");
  TORCH_CHECK(tables.size(0) == batch && lengths.size(0) == batch, "one table per sequence");
  TORCH_CHECK(layer >= 0 && layer < geo.layers, "layer out of range");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be 0 (none) or positive");
  const float* sink_data = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == heads,
                "sinks must be a contiguous float32 [heads] tensor");
    sink_data = sinks->data_ptr<float>();
  }
  const int64_t group = heads / geo.kv_heads;
  const DecodeFn fn = decode_for(first.scalar_type(), group, head_dim, softcap > 0);
  TORCH_CHECK(fn != nullptr, "no kernel for this head layout or dtype");
  std::vector<const void*> bases;
  bases.reserve(segments.size());
  for (const at::Tensor& s : segments) {
    TORCH_CHECK(s.is_contiguous() && s.sizes() == first.sizes() &&
                    s.scalar_type() == first.scalar_type(),
                "segments must be contiguous and alike");
    bases.push_back(s.data_ptr());
  }
  const int64_t pool_pages = geo.segment_pages * static_cast<int64_t>(segments.size());
  const int64_t width = tables.size(1);
  const int32_t* table_data = tables.data_ptr<int32_t>();
  const int32_t* length_data = lengths.data_ptr<int32_t>();
  // the first key each sequence attends to: 0, or the start of its window
  auto start_of = [&](int64_t length) {
    return window > 0 && length > window ? length - window : int64_t{0};
  };
  for (int64_t b = 0; b < batch; ++b) {  // checked here, not trusted: a bad id would read anywhere
    const int64_t length = length_data[b];
    TORCH_CHECK(length >= 1 && length <= width * geo.page_size, "a length exceeds its table");
    const int64_t used = (length + geo.page_size - 1) / geo.page_size;
    for (int64_t j = start_of(length) / geo.page_size; j < used; ++j) {  // the pages read
      const int32_t page = table_data[b * width + j];
      TORCH_CHECK(page >= 0 && page < pool_pages, "page id outside the pool");
    }
  }
  at::Tensor out = at::empty_like(q);
  const float* q_data = q.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, batch * geo.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / geo.kv_heads, kv_head = item % geo.kv_heads;
      const int64_t offset = (b * heads + kv_head * group) * head_dim;
      const float* head_sinks = sink_data ? sink_data + kv_head * group : nullptr;
      fn(bases.data(), geo, layer, table_data + b * width, start_of(length_data[b]),
         length_data[b], kv_head, q_data + offset, s, cap, head_sinks, out_data + offset);
    }
  });
  return out;
}

// ---- writing new tokens' K/V into their pages ------------------------------------------------

// k, v [T, kv_heads, head_dim] (rows may be strided, as views of a fused qkv product), each
// token's K and V copied into its slot (page, offset) of one layer: one call per layer instead
// of a concatenation and an indexed copy per segment.
void write_kv(const std::vector<at::Tensor>& segments, int64_t layer, const at::Tensor& pages,
              const at::Tensor& offsets, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(!segments.empty(), "at least one segment");
  const at::Tensor& first = segments[0];
  const int64_t segment_pages = first.size(0), layers = first.size(1), page_size = first.size(3);
  const int64_t kv_heads = first.size(4), head_dim = first.size(5);
  const int64_t row = kv_heads * head_dim;
  TORCH_CHECK(k.dim() == 3 && k.size(1) == kv_heads && k.size(2) == head_dim && k.sizes() == v.sizes(),
              "k and v must be [tokens, kv_heads, head_dim] like the pages");
  TORCH_CHECK(k.scalar_type() == first.scalar_type() && v.scalar_type() == first.scalar_type(),
              "k and v must have the pages' dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == head_dim && v.stride(2) == 1 && v.stride(1) == head_dim,
              "each token's k and v must be contiguous");
  TORCH_CHECK(pages.scalar_type() == at::kInt && offsets.scalar_type() == at::kInt &&
                  pages.is_contiguous() && offsets.is_contiguous() &&
                  pages.numel() == k.size(0) && offsets.numel() == k.size(0),
              "one int32 page and offset per token");
  TORCH_CHECK(layer >= 0 && layer < layers, "layer out of range");
  const int64_t tokens = k.size(0), pool_pages = segment_pages * static_cast<int64_t>(segments.size());
  const int32_t* page_data = pages.data_ptr<int32_t>();
  const int32_t* offset_data = offsets.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(page_data[t] >= 0 && page_data[t] < pool_pages && offset_data[t] >= 0 &&
                    offset_data[t] < page_size,
                "a slot outside the pool");
  const int64_t item = first.element_size();
  std::vector<char*> bases;
  for (const at::Tensor& s : segments) bases.push_back(static_cast<char*>(s.data_ptr()));
  const char* k_data = static_cast<const char*>(k.data_ptr());
  const char* v_data = static_cast<const char*>(v.data_ptr());
  const int64_t page_elements = page_size * row;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page = page_data[t];
    char* base = bases[page / segment_pages] +
                 (((page % segment_pages) * layers + layer) * 2 * page_elements +
                  offset_data[t] * row) * item;
    std::memcpy(base, k_data + t * k.stride(0) * item, row * item);
    std::memcpy(base + page_elements * item, v_data + t * v.stride(0) * item, row * item);
  }
}

// ---- packed linear --------------------------------------------------------------------------

constexpr int64_t BLOCK = 16;  // output columns per block: one vector
constexpr int MAX_ROWS = 14;   // rows of x per tile: 2 x 14 accumulators + 2 weights + 1 input

// W [N, K] -> [ceil(N / 16), K, 16], zero-padded columns past N.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "the weight must be a float32 [out, in] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  at::Tensor padded = weight;
  if (blocks * BLOCK != n) {
    padded = at::zeros({blocks * BLOCK, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
  }
  return padded.view({blocks, BLOCK, k}).transpose(1, 2).contiguous();
}

inline __mmask16 first_lanes(int64_t count) {
  return static_cast<__mmask16>(count >= 16 ? 0xFFFF : count <= 0 ? 0 : (1u << count) - 1);
}

// R rows of x against one or two adjacent blocks (`second` null for one). Two blocks are two
// sequential streams of 64 bytes per k, which the hardware prefetches better than one stream of
// 128 (measured 20 % faster at 8 rows).
template <int R>
void block_tile(const float* x, int64_t k_size, const float* first, const float* second, float* y,
                int64_t ldy, int64_t columns, const float* bias) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm512_setzero_ps();
    hi[r] = _mm512_setzero_ps();
  }
  if (second != nullptr) {
    for (int64_t k = 0; k < k_size; ++k) {
      const __m512 w0 = _mm512_loadu_ps(first + k * BLOCK);
      const __m512 w1 = _mm512_loadu_ps(second + k * BLOCK);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * k_size + k]);
        lo[r] = _mm512_fmadd_ps(w0, xb, lo[r]);
        hi[r] = _mm512_fmadd_ps(w1, xb, hi[r]);
      }
    }
  } else {
    for (int64_t k = 0; k < k_size; ++k) {
      const __m512 w0 = _mm512_loadu_ps(first + k * BLOCK);
      for (int r = 0; r < R; ++r)
        lo[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * k_size + k]), lo[r]);
    }
  }
  const __mmask16 m0 = first_lanes(columns), m1 = first_lanes(columns - BLOCK);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(m1, bias + BLOCK) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(lo[r], b0));
    if (m1) _mm512_mask_storeu_ps(y + r * ldy + BLOCK, m1, _mm512_add_ps(hi[r], b1));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t,
                        int64_t, const float*);

template <int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> make_tiles(std::integer_sequence<int, R...>) {
  return {nullptr, block_tile<R + 1>...};
}
constexpr auto TILES = make_tiles(std::make_integer_sequence<int, MAX_ROWS>{});

// x [M, K] float32, packed from pack_linear_weight, bias [N] or none -> [M, N].
// Row tiles per chunk of packed_linear: 16 tiles of 14 rows of 576 floats is about 500 KB.
constexpr int64_t CHUNK_TILES = 16;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [rows, in]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BLOCK && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed must come from pack_linear_weight");
  const at::Tensor input = x.contiguous();
  const int64_t m = input.size(0), k = input.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " columns, the weight ", packed.size(1));
  TORCH_CHECK(n > (blocks - 1) * BLOCK && n <= blocks * BLOCK, "n does not match the blocks");
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be float32 [n]");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, input.options());
  if (m == 0) return y;
  const float* x_data = input.data_ptr<float>();
  const float* w_data = packed.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  const int64_t tiles = (m + MAX_ROWS - 1) / MAX_ROWS;
  const int64_t pairs = (blocks + 1) / 2;
  // Each thread takes a contiguous range of block pairs. Rows go by chunks of CHUNK_TILES tiles
  // that stay in L2 while the thread's pairs pass over them: x is read from memory once, and
  // the weights once per chunk (not once per tile, which a wide layer could not keep in cache).
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < tiles; t0 += CHUNK_TILES) {
      const int64_t t1 = std::min<int64_t>(tiles, t0 + CHUNK_TILES);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t b = 2 * pair;
        const float* first = w_data + b * k * BLOCK;
        const float* second = b + 1 < blocks ? first + k * BLOCK : nullptr;
        const int64_t columns = std::min<int64_t>(2 * BLOCK, n - b * BLOCK);
        const float* bias_at = bias_data != nullptr ? bias_data + b * BLOCK : nullptr;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r0 = t * m / tiles, r1 = (t + 1) * m / tiles;
          TILES[r1 - r0](x_data + r0 * k, k, first, second, y_data + r0 * n + b * BLOCK, n,
                         columns, bias_at);
        }
      }
    }
  });
  return y;
}

// ---- elementwise steps of a layer (float32 or bfloat16) -------------------------------------
//
// bfloat16 rows are read into float32 and every step is computed in float32; a value is rounded
// to bfloat16 (to nearest even) where Hugging Face's bfloat16 modules round it: the residual
// after each add, the normalised row before it is scaled by the norm's weight, silu(gate) before
// it is multiplied by up, and each output. For float32 the rounding is the identity, so the
// float32 results are those of the float32-only kernels before.

constexpr int64_t ROWS_PER_TASK = 32;  // elementwise work below this many rows stays on one thread

inline float sum16(__m512 v) { return _mm512_reduce_add_ps(v); }

// float32 bits rounded to the nearest even bfloat16, in the high half of each lane (NaN stays
// a quiet NaN).
inline __m512i bf16_bits(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}

// v as it reads back after being stored as T.
template <typename T>
inline __m512 stored(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(0xFFFF0000)));
  }
}
template <typename T>
inline float stored(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// out = weight * x * rsqrt(mean(x^2) + eps), one row of `n` values, the sums in float32. A weight
// of the rows' type rounds as Llama's RMSNorm does (x * rsqrt rounded to the row type, then the
// weight); a float32 weight on bfloat16 rows as Gemma's (the product in float32, rounded once).
template <typename T, typename W>
inline void rms_norm_row(const T* x, const W* weight, float eps, int64_t n, T* out) {
  constexpr bool round_first = std::is_same_v<T, W>;
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float sum = sum16(acc);
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 normed = _mm512_mul_ps(load16(x + i), iv);
    if constexpr (round_first) normed = stored<T>(normed);
    store16(out + i, _mm512_mul_ps(load16(weight + i), normed));
  }
  for (; i < n; ++i) {
    float normed = static_cast<float>(x[i]) * inv;
    if constexpr (round_first) normed = stored<T>(normed);
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
  }
}

// The element type of float32 or bfloat16 tensors, for a kernel templated on it.
template <typename Fn>
auto with_type(at::ScalarType type, Fn&& fn) {
  if (type == at::kBFloat16) return fn(at::BFloat16{});
  return fn(float{});
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType type) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name,
              " must be a contiguous [rows, features] tensor");
  TORCH_CHECK(t.scalar_type() == type, name, " must have the dtype of the others (",
              type, "), not ", t.scalar_type());
}

at::ScalarType row_type(const at::Tensor& x) {
  const at::ScalarType type = x.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "rows must be float32 or bfloat16");
  return type;
}

// A norm's weight: one value per column, in the rows' type or float32 (`rms_norm_row`).
void check_norm_weight(const at::Tensor& weight, int64_t n, at::ScalarType type) {
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() &&
                  (weight.scalar_type() == type || weight.scalar_type() == at::kFloat),
              "weight must have one value per column, in x's dtype or float32");
}

// `with_type` for rows and a norm weight: (T, T), or (bfloat16, float) for Gemma's norms.
template <typename Fn>
auto with_types(at::ScalarType type, at::ScalarType weight_type, Fn&& fn) {
  if (type == at::kBFloat16 && weight_type == at::kFloat) return fn(at::BFloat16{}, float{});
  return with_type(type, [&](auto zero) { return fn(zero, zero); });
}

// RMSNorm of x [T, n] -> new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType type = row_type(x);
  check_rows(x, "x", type);
  const int64_t rows = x.size(0), n = x.size(1);
  check_norm_weight(weight, n, type);
  at::Tensor out = at::empty_like(x);
  with_types(type, weight.scalar_type(), [&](auto zero, auto weight_zero) {
    using T = decltype(zero);
    using W = decltype(weight_zero);
    const T* xd = x.data_ptr<T>();
    const W* wd = weight.data_ptr<W>();
    T* od = out.data_ptr<T>();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(xd + r * n, wd, static_cast<float>(eps), n, od + r * n);
    });
    return 0;
  });
  return out;
}

// residual += x (in place), then RMSNorm of the new residual -> new tensor: the residual add of
// one block and the norm that opens the next, in one pass.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                         double eps) {
  const at::ScalarType type = row_type(residual);
  check_rows(residual, "residual", type);
  check_rows(x, "x", type);
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual and x differ in shape");
  const int64_t rows = x.size(0), n = x.size(1);
  check_norm_weight(weight, n, type);
  at::Tensor out = at::empty_like(x);
  with_types(type, weight.scalar_type(), [&](auto zero, auto weight_zero) {
    using T = decltype(zero);
    using W = decltype(weight_zero);
    T* rd = residual.data_ptr<T>();
    const T* xd = x.data_ptr<T>();
    const W* wd = weight.data_ptr<W>();
    T* od = out.data_ptr<T>();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = rd + r * n;
        const T* add = xd + r * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) store16(row + i, _mm512_add_ps(load16(row + i), load16(add + i)));
        for (; i < n; ++i)
          row[i] = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(add[i]));
        rms_norm_row(row, wd, static_cast<float>(eps), n, od + r * n);
      }
    });
    return 0;
  });
  return out;
}

// Rotary embeddings in place on the first `heads` heads of each row of qkv [T, *] (the queries
// then the keys of a fused product), half-split layout: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin,
// with cos/sin [T, rot] (each half repeated, as Hugging Face builds them) over the first rot
// dimensions of each head of head_dim (rot < head_dim: a partial rope, Phi-4-mini's; the rest of
// the head stays as it is).
void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             int64_t head_dim) {
  const at::ScalarType type = row_type(qkv);
  check_rows(qkv, "qkv", type);
  check_rows(cos, "cos", type);
  check_rows(sin, "sin", type);
  const int64_t rows = qkv.size(0), width = qkv.size(1), rot = cos.size(1), half = rot / 2;
  TORCH_CHECK(heads * head_dim <= width, "heads do not fit the rows");
  TORCH_CHECK(cos.size(0) == rows && rot % 2 == 0 && rot <= head_dim && sin.sizes() == cos.sizes(),
              "cos and sin must be [rows, an even number of dimensions up to head_dim]");
  with_type(type, [&](auto zero) {
    using T = decltype(zero);
    T* qd = qkv.data_ptr<T>();
    const T* cd = cos.data_ptr<T>();
    const T* sd = sin.data_ptr<T>();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* c = cd + r * rot;
        const T* s = sd + r * rot;
        for (int64_t h = 0; h < heads; ++h) {
          T* x1 = qd + r * width + h * head_dim;
          T* x2 = x1 + half;
          int64_t i = 0;
          for (; i + 16 <= half; i += 16) {
            const __m512 a = load16(x1 + i), b = load16(x2 + i);
            const __m512 c1 = load16(c + i), s1 = load16(s + i);
            const __m512 c2 = load16(c + half + i), s2 = load16(s + half + i);
            store16(x1 + i, _mm512_fnmadd_ps(b, s1, _mm512_mul_ps(a, c1)));
            store16(x2 + i, _mm512_fmadd_ps(a, s2, _mm512_mul_ps(b, c2)));
          }
          for (; i < half; ++i) {
            const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
            x1[i] = static_cast<T>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
            x2[i] = static_cast<T>(b * static_cast<float>(c[half + i]) +
                                   a * static_cast<float>(s[half + i]));
          }
        }
      }
    });
    return 0;
  });
}

// SwiGLU: gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I].
// The activations of a gated MLP, act(gate) * up: 16 lanes, and one value for a row's tail.
struct Silu {  // x / (1 + exp(-x)); exp512 takes any x (clamped below at -87)
  static __m512 lanes(__m512 x) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  }
  static float one(float x) { return x / (1.f + std::exp(-x)); }
};

struct GeluTanh {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's approximate="tanh"
  static constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  static __m512 lanes(__m512 x) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner =
        _mm512_mul_ps(_mm512_set1_ps(kBeta), _mm512_fmadd_ps(_mm512_set1_ps(kKappa), cube, x));
    const __m512 half = _mm512_mul_ps(_mm512_set1_ps(0.5f), x);
    return _mm512_mul_ps(half, _mm512_add_ps(_mm512_set1_ps(1.f), tanh512(inner)));
  }
  static float one(float x) {
    return 0.5f * x * (1.f + std::tanh(kBeta * (x + kKappa * x * x * x)));
  }
};

// act(gate) * up over a [rows, 2n] gate_up product, the activation rounded to the row type
// before the product as torch's two operations round it.
template <typename Act>
at::Tensor act_and_mul(const at::Tensor& gate_up) {
  const at::ScalarType type = row_type(gate_up);
  check_rows(gate_up, "gate_up", type);
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  with_type(type, [&](auto zero) {
    using T = decltype(zero);
    const T* gd = gate_up.data_ptr<T>();
    T* od = out.data_ptr<T>();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = gd + r * 2 * n;
        const T* u = g + n;
        T* o = od + r * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
          const __m512 act = stored<T>(Act::lanes(load16(g + i)));
          store16(o + i, _mm512_mul_ps(act, load16(u + i)));
        }
        for (; i < n; ++i) {
          const float act = stored<T>(Act::one(static_cast<float>(g[i])));
          o[i] = static_cast<T>(act * static_cast<float>(u[i]));
        }
      }
    });
    return 0;
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) { return act_and_mul<Silu>(gate_up); }

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  return act_and_mul<GeluTanh>(gate_up);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("segments"),
        py::arg("tables"), py::arg("lengths"), py::arg("layer"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("write_kv", &write_kv);
  m.def("decode_supported", &decode_supported);
  m.def("pack_linear_weight", &pack_linear_weight);
  m.def("packed_linear", &packed_linear);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rotary_", &rotary_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul);
}
