// Fused, multi-threaded fp32 CPU kernels for the per-element work of a training step.
//
// Why: Paddle 3.3's CPU softmax, add, exp, ... run on one thread and make one pass over memory
// each (docs/performance.md, items 7 and 8), so at short sequences they, not the GEMMs, decide
// the step time. Each kernel here is one pass per row, rows split over OpenMP threads (the
// libiomp5 that Paddle's MKL already runs, so the two share one thread pool); the matmul kernels
// call MKL's sgemm directly. Built and loaded by ops/kernels.py; every caller keeps a Paddle-op
// fallback with the same maths. The file is the package's one native build: its last section holds
// the checkpoint loader's transposes, plain C entry points on numpy buffers (ops/transpose.py).
//
// Floating tensors are fp32, index tensors int64; all contiguous, on the CPU (checked by
// ops/kernels.py's `usable`).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "paddle/extension.h"

namespace {

// Below this many elements a kernel runs on the calling thread only: waking the pool costs more.
constexpr int64_t kParallelMin = 1 << 14;

// exp(x) without a library call, so that the loops over it vectorise: 2^n * p(r) with
// r = x - n ln2 (ln2 split in two for exactness) and Cephes' degree-6 polynomial for exp(r),
// about 1 ulp. x below -87.34 (and -inf) gives 0; above 88.72 gives +inf.
inline float exp_f32(float x) {
  constexpr float lo = -87.33654f, hi = 88.72283f;
  const float xc = x < lo ? lo : (x > hi ? hi : x);
  const float n = __builtin_roundf(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  return x < lo ? 0.0f : (x > hi ? std::numeric_limits<float>::infinity() : y);
}

}  // namespace

// s [G, H, I, T] := softmax over T of (s + mask[g, i, :]), in place: the mask is shared by the H
// heads (per-head dense attention: I = the query rows; a 3-D s [G, H, T] with mask [G, T] is
// I = 1, the latent chunks). A row whose scores are all -inf gives NaN, as Paddle's add +
// softmax does.
void MaskedSoftmax(paddle::Tensor& s, const paddle::Tensor& mask) {
  const auto& shp = s.shape();
  const int64_t G = shp[0], H = shp[1], I = shp.size() == 4 ? shp[2] : 1, T = shp.back();
  float* sp = s.data<float>();
  const float* mp = mask.data<float>();
  const int64_t rows = G * H * I;
#pragma omp parallel for schedule(static) if (rows * T >= kParallelMin)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t g = row / (H * I), i = row % I;
    float* x = sp + row * T;
    const float* m = mp + (g * I + i) * T;
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < T; ++t) {
      const float v = x[t] + m[t];
      x[t] = v;
      mx = v > mx ? v : mx;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < T; ++t) {
      const float e = exp_f32(x[t] - mx);
      x[t] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < T; ++t) x[t] *= inv;
  }
}

// dp := p * (dp - sum(p * dp)) over the last axis, in place: the softmax backward.
void SoftmaxBackward(const paddle::Tensor& p, paddle::Tensor& dp) {
  const int64_t T = p.shape().back();
  const int64_t rows = T ? p.numel() / T : 0;
  const float* pp = p.data<float>();
  float* gp = dp.data<float>();
#pragma omp parallel for schedule(static) if (rows * T >= kParallelMin)
  for (int64_t row = 0; row < rows; ++row) {
    const float* a = pp + row * T;
    float* g = gp + row * T;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t t = 0; t < T; ++t) dot += a[t] * g[t];
#pragma omp simd
    for (int64_t t = 0; t < T; ++t) g[t] = a[t] * (g[t] - dot);
  }
}

// RMSNorm forward over rows of x [N, D]: r = 1 / sqrt(mean(x^2) + eps) (the mean accumulated in
// fp64), y = w * (x * r), each product rounded to fp32 as HF's op-by-op form rounds it.
// Returns y [N, D] and r [N] (what the backward needs besides x and w).
std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
  const int64_t D = x.shape().back();
  const int64_t N = D ? x.numel() / D : 0;
  auto y = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto r = paddle::empty({N}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* yp = y.data<float>();
  float* rp = r.data<float>();
#pragma omp parallel for schedule(static) if (N * D >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = xp + n * D;
    float* yr = yp + n * D;
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(xr[d]) * xr[d];
    const float var = static_cast<float>(ss / D);
    const float rs = 1.0f / std::sqrt(var + eps);
    rp[n] = rs;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const float normed = xr[d] * rs;
      yr[d] = wp[d] * normed;
    }
  }
  return {y, r};
}

// RMSNorm backward: with n = x * r and gn = dy * w,
//   dx = r * (gn - n * mean(gn * n)),   dw = sum over rows of dy * n.
// dw is summed in fp64, per thread over a fixed static split of the rows, then over the threads
// in order: the same result for the same thread count.
std::vector<paddle::Tensor> RmsNormBackward(const paddle::Tensor& x,
                                            const paddle::Tensor& w,
                                            const paddle::Tensor& r,
                                            const paddle::Tensor& dy) {
  const int64_t D = x.shape().back();
  const int64_t N = D ? x.numel() / D : 0;
  auto dx = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto dw = paddle::empty({D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  const float* rp = r.data<float>();
  const float* gp = dy.data<float>();
  float* dxp = dx.data<float>();
  const bool parallel = N * D >= kParallelMin;
  const int threads = parallel ? omp_get_max_threads() : 1;
  std::vector<double> partial(static_cast<size_t>(threads) * D, 0.0);
#pragma omp parallel num_threads(threads) if (parallel)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
    double* acc = partial.data() + static_cast<size_t>(t) * D;
    for (int64_t n = n0; n < n1; ++n) {
      const float* xr = xp + n * D;
      const float* g = gp + n * D;
      float* out = dxp + n * D;
      const float rs = rp[n];
      double dot = 0.0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) {
        const float normed = xr[d] * rs;
        dot += static_cast<double>(g[d] * wp[d]) * normed;
        acc[d] += static_cast<double>(g[d]) * normed;
      }
      const float mean = static_cast<float>(dot / D);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        const float normed = xr[d] * rs;
        out[d] = (g[d] * wp[d] - normed * mean) * rs;
      }
    }
  }
  float* dwp = dw.data<float>();
  for (int64_t d = 0; d < D; ++d) {
    double s = 0.0;
    for (int t = 0; t < threads; ++t) s += partial[static_cast<size_t>(t) * D + d];
    dwp[d] = static_cast<float>(s);
  }
  return {dx, dw};
}

// SwiGLU on h [..., 2I] (gate columns first, as the fused up_gate_proj lays them out):
// act = silu(gate) * up, times scale[row] when scale is non-empty (the MoE routing weight, applied
// here, before the down projection, instead of after it: the same product, another rounding).
std::vector<paddle::Tensor> Swiglu(const paddle::Tensor& h, const paddle::Tensor& scale) {
  const int64_t I = h.shape().back() / 2;
  const int64_t rows = I ? h.numel() / (2 * I) : 0;
  std::vector<int64_t> shape = h.shape();
  shape.back() = I;
  auto act = paddle::empty(shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* hp = h.data<float>();
  const float* sp = scale.numel() ? scale.data<float>() : nullptr;
  PD_CHECK(!sp || scale.numel() == rows, "swiglu: ", scale.numel(), " row scales for ", rows, " rows");
  float* ap = act.data<float>();
#pragma omp parallel for schedule(static) if (rows * I >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = hp + r * 2 * I;
    const float* u = g + I;
    float* out = ap + r * I;
    const float w = sp ? sp[r] : 1.0f;
#pragma omp simd
    for (int64_t j = 0; j < I; ++j) {
      const float silu = g[j] / (1.0f + exp_f32(-g[j]));
      out[j] = sp ? silu * u[j] * w : silu * u[j];
    }
  }
  return {act};
}

// Its backward: dh [..., 2I] and, when scaled, dscale [rows] = sum_j dact * silu(gate) * up.
std::vector<paddle::Tensor> SwigluBackward(const paddle::Tensor& h, const paddle::Tensor& scale,
                                           const paddle::Tensor& dact) {
  const int64_t I = h.shape().back() / 2;
  const int64_t rows = I ? h.numel() / (2 * I) : 0;
  auto dh = paddle::empty(h.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* sp = scale.numel() ? scale.data<float>() : nullptr;
  auto ds = paddle::empty({sp ? rows : 0}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* hp = h.data<float>();
  const float* dap = dact.data<float>();
  float* dhp = dh.data<float>();
  float* dsp = sp ? ds.data<float>() : nullptr;
#pragma omp parallel for schedule(static) if (rows * I >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = hp + r * 2 * I;
    const float* u = g + I;
    const float* da = dap + r * I;
    float* dg = dhp + r * 2 * I;
    float* du = dg + I;
    const float w = sp ? sp[r] : 1.0f;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < I; ++j) {
      const float sig = 1.0f / (1.0f + exp_f32(-g[j]));
      const float silu = g[j] * sig;
      const float d = da[j] * w;
      dg[j] = d * u[j] * sig * (1.0f + g[j] * (1.0f - sig));
      du[j] = d * silu;
      dot += da[j] * silu * u[j];
    }
    if (dsp) dsp[r] = dot;
  }
  return {dh, ds};
}

std::vector<std::vector<int64_t>> SwigluShape(const std::vector<int64_t>& h, const std::vector<int64_t>& s) {
  std::vector<int64_t> out = h;
  out.back() /= 2;
  return {out};
}

std::vector<std::vector<int64_t>> SwigluBackwardShape(const std::vector<int64_t>& h,
                                                      const std::vector<int64_t>& s,
                                                      const std::vector<int64_t>& da) {
  return {h, s};
}

std::vector<paddle::DataType> OneFloat32Of2(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<paddle::DataType> TwoFloat32Of3In(const paddle::DataType&, const paddle::DataType&,
                                              const paddle::DataType&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32};
}

// Cross entropy per row of logits [N, V] against target [N]: loss = logsumexp(x) - x[target]
// (0 where target == ignore_index); also returns logsumexp [N] for the backward. A target
// outside [0, V) other than ignore_index is an error naming the row.
std::vector<paddle::Tensor> CrossEntropy(const paddle::Tensor& logits, const paddle::Tensor& target,
                                         int64_t ignore_index) {
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  auto loss = paddle::empty({N}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto lse = paddle::empty({N}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = logits.data<float>();
  const int64_t* tp = target.data<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    PD_CHECK(tp[n] == ignore_index || (tp[n] >= 0 && tp[n] < V), "cross entropy: target ", tp[n], " at row ", n,
             " is outside the vocabulary [0, ", V, ")");
  float* lp = loss.data<float>();
  float* sp = lse.data<float>();
#pragma omp parallel for schedule(static) if (N * V >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = xp + n * V;
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t v = 0; v < V; ++v) mx = x[v] > mx ? x[v] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < V; ++v) sum += exp_f32(x[v] - mx);
    const float l = mx + std::log(sum);
    sp[n] = l;
    lp[n] = tp[n] == ignore_index ? 0.0f : l - x[tp[n]];
  }
  return {loss, lse};
}

// Its backward: dlogits = (softmax(x) - onehot(target)) * g[row], 0 on ignored rows.
std::vector<paddle::Tensor> CrossEntropyBackward(const paddle::Tensor& logits, const paddle::Tensor& target,
                                                 const paddle::Tensor& lse, const paddle::Tensor& g,
                                                 int64_t ignore_index) {
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  auto dx = paddle::empty({N, V}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = logits.data<float>();
  const int64_t* tp = target.data<int64_t>();
  const float* sp = lse.data<float>();
  const float* gp = g.data<float>();
  float* dp = dx.data<float>();
#pragma omp parallel for schedule(static) if (N * V >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = xp + n * V;
    float* d = dp + n * V;
    if (tp[n] == ignore_index) {
      std::memset(d, 0, sizeof(float) * V);
      continue;
    }
    const float l = sp[n], w = gp[n];
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) d[v] = exp_f32(x[v] - l) * w;
    d[tp[n]] -= w;
  }
  return {dx};
}

std::vector<std::vector<int64_t>> CrossEntropyShape(const std::vector<int64_t>& x, const std::vector<int64_t>& t) {
  return {{x[0]}, {x[0]}};
}

std::vector<std::vector<int64_t>> CrossEntropyBackwardShape(const std::vector<int64_t>& x,
                                                            const std::vector<int64_t>& t,
                                                            const std::vector<int64_t>& l,
                                                            const std::vector<int64_t>& g) {
  return {x};
}

std::vector<paddle::DataType> OneFloat32Of4(const paddle::DataType&, const paddle::DataType&,
                                            const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

// The index tables of a top-k for the latent attention's gathered chunks: for topk [B*S, K]
// (key positions within the batch, -1 = empty) of B batches of S queries:
//   rows[r, j]  = b*S + topk[r, j] for a valid slot; an empty slot points at b*S (masked out) or,
//                 when the query has no key at all, at the batch's mean row B*S + b (not masked);
//   mask[r, j]  = 0 for a valid slot or a query without keys, -inf otherwise;
//   has_key[r]  = the query has at least one valid slot.
std::vector<paddle::Tensor> TopkTables(const paddle::Tensor& topk, int64_t S) {
  const int64_t R = topk.shape()[0], K = topk.shape()[1];
  PD_CHECK(S > 0 && R % S == 0, "topk tables: ", R, " rows are not whole batches of ", S);
  const int64_t B = R / S;
  auto rows = paddle::empty({R, K}, paddle::DataType::INT64, paddle::CPUPlace());
  auto mask = paddle::empty({R, K}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto has = paddle::empty({R}, paddle::DataType::BOOL, paddle::CPUPlace());
  const int64_t* tp = topk.data<int64_t>();
  int64_t* rp = rows.data<int64_t>();
  float* mp = mask.data<float>();
  bool* hp = has.data<bool>();
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) if (R * K >= kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = r / S;
    const int64_t* t = tp + r * K;
    bool any = false;
    for (int64_t j = 0; j < K; ++j) any |= t[j] >= 0;
    hp[r] = any;
    for (int64_t j = 0; j < K; ++j) {
      const bool valid = t[j] >= 0;
      rp[r * K + j] = valid ? b * S + t[j] : (any ? b * S : B * S + b);
      mp[r * K + j] = (valid || !any) ? 0.0f : ninf;
    }
  }
  return {rows, mask, has};
}

// Additive mask [R, width (+1)] from selections sel [R, K] (-1 = empty, else < width): 0 at each
// row's selected columns, `fill` elsewhere; with mean_col, one more column that is 0 for a row
// without any selection (it then attends to the batch's mean row) and `fill` otherwise.
std::vector<paddle::Tensor> SelectionMask(const paddle::Tensor& sel, int64_t width, float fill, bool mean_col) {
  const int64_t R = sel.shape()[0], K = sel.shape()[1];
  const int64_t W = width + (mean_col ? 1 : 0);
  auto mask = paddle::empty({R, W}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const int64_t* sp = sel.data<int64_t>();
  float* mp = mask.data<float>();
  for (int64_t i = 0; i < R * K; ++i)
    PD_CHECK(sp[i] < width, "selection mask: selected column ", sp[i], " in row ", i / K, " is not below ", width);
#pragma omp parallel for schedule(static) if (R * W >= kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    float* m = mp + r * W;
    for (int64_t w = 0; w < W; ++w) m[w] = fill;
    bool any = false;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t c = sp[r * K + j];
      if (c >= 0) {
        m[c] = 0.0f;
        any = true;
      }
    }
    if (mean_col && !any) m[width] = 0.0f;
  }
  return {mask};
}

std::vector<std::vector<int64_t>> TopkTablesShape(const std::vector<int64_t>& t, int64_t S) {
  return {t, t, {t[0]}};
}

std::vector<paddle::DataType> TopkTablesDtype(const paddle::DataType&) {
  return {paddle::DataType::INT64, paddle::DataType::FLOAT32, paddle::DataType::BOOL};
}

std::vector<std::vector<int64_t>> SelectionMaskShape(const std::vector<int64_t>& sel, int64_t width, float fill,
                                                     bool mean_col) {
  return {{sel[0], width + (mean_col ? 1 : 0)}};
}

std::vector<paddle::DataType> OneFloat32Of1(const paddle::DataType&) { return {paddle::DataType::FLOAT32}; }

// Rotary embedding fused with the concatenation it feeds: out [N, Da + Dr] = [a, rope(r)] (or
// [rope(r), a] with rope_first) for rows n = (b * S + s) * H + h of a [N, Da] and r [N, Dr].
// cos / sin [Bc * S, Dr / 2] (Bc = 1 or B). rope(r) = [r1 c - r2 s, r2 c + r1 s] with (r1, r2)
// the even / odd elements (interleave) or the two halves of r: the arithmetic of rope_heads.
namespace {
struct RopeRows {
  int64_t N, Da, Dr, H, S, half, cs_rows;
  const float *cp, *sp;
  const float* cos_row(int64_t n) const {
    const int64_t pos = (n / H) % S, b = n / (H * S);
    return cp + (cs_rows == S ? pos : b * S + pos) * half;
  }
  const float* sin_row(int64_t n) const { return sp + (cos_row(n) - cp); }
};

RopeRows MakeRopeRows(int64_t N, int64_t Da, int64_t Dr, const paddle::Tensor& cos, const paddle::Tensor& sin,
                      int64_t H, int64_t S) {
  PD_CHECK(Dr % 2 == 0 && H > 0 && S > 0 && N % (H * S) == 0, "rope: ", N, " rows are not B x ", S, " x ", H);
  const int64_t half = Dr / 2, cs_rows = cos.numel() / std::max<int64_t>(half, 1);
  PD_CHECK(cos.numel() == sin.numel() && (cs_rows == S || cs_rows == N / H), "rope: cos/sin of ", cos.numel(),
           " values for ", S, " positions of ", half);
  return {N, Da, Dr, H, S, half, cs_rows, cos.data<float>(), sin.data<float>()};
}
}  // namespace

std::vector<paddle::Tensor> RopeConcat(const paddle::Tensor& a, const paddle::Tensor& r, const paddle::Tensor& cos,
                                       const paddle::Tensor& sin, int64_t H, int64_t S, bool rope_first,
                                       bool interleave) {
  const int64_t Dr = r.shape().back(), N = Dr ? r.numel() / Dr : 0;
  const int64_t Da = N ? a.numel() / N : 0;
  const RopeRows g = MakeRopeRows(N, Da, Dr, cos, sin, H, S);
  std::vector<int64_t> shape = r.shape();
  shape.back() = Da + Dr;
  auto out = paddle::empty(shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* ap = a.data<float>();
  const float* rp = r.data<float>();
  float* op = out.data<float>();
  const int64_t W = Da + Dr, ro = rope_first ? 0 : Da, ao = rope_first ? Dr : 0;
#pragma omp parallel for schedule(static) if (N * W >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* c = g.cos_row(n);
    const float* s = g.sin_row(n);
    const float* x = rp + n * Dr;
    float* o = op + n * W;
    std::memcpy(o + ao, ap + n * Da, sizeof(float) * Da);
    for (int64_t i = 0; i < g.half; ++i) {
      const float x1 = interleave ? x[2 * i] : x[i], x2 = interleave ? x[2 * i + 1] : x[i + g.half];
      o[ro + i] = x1 * c[i] - x2 * s[i];
      o[ro + g.half + i] = x2 * c[i] + x1 * s[i];
    }
  }
  return {out};
}

// Its backward: da = dout's a part; dr = rope^T(dout's rope part), re-interleaved.
std::vector<paddle::Tensor> RopeConcatBackward(const paddle::Tensor& dout, const paddle::Tensor& cos,
                                               const paddle::Tensor& sin, int64_t Da, int64_t H, int64_t S,
                                               bool rope_first, bool interleave) {
  const int64_t W = dout.shape().back(), Dr = W - Da, N = W ? dout.numel() / W : 0;
  const RopeRows g = MakeRopeRows(N, Da, Dr, cos, sin, H, S);
  std::vector<int64_t> sa = dout.shape(), sr = dout.shape();
  sa.back() = Da;
  sr.back() = Dr;
  auto da = paddle::empty(sa, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto dr = paddle::empty(sr, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* gp = dout.data<float>();
  float* dap = da.data<float>();
  float* drp = dr.data<float>();
  const int64_t ro = rope_first ? 0 : Da, ao = rope_first ? Dr : 0;
#pragma omp parallel for schedule(static) if (N * W >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* c = g.cos_row(n);
    const float* s = g.sin_row(n);
    const float* go = gp + n * W;
    float* x = drp + n * Dr;
    std::memcpy(dap + n * Da, go + ao, sizeof(float) * Da);
    for (int64_t i = 0; i < g.half; ++i) {
      const float g1 = go[ro + i], g2 = go[ro + g.half + i];
      const float d1 = g1 * c[i] + g2 * s[i], d2 = g2 * c[i] - g1 * s[i];
      if (interleave) {
        x[2 * i] = d1;
        x[2 * i + 1] = d2;
      } else {
        x[i] = d1;
        x[i + g.half] = d2;
      }
    }
  }
  return {da, dr};
}

std::vector<std::vector<int64_t>> RopeConcatShape(const std::vector<int64_t>& a, const std::vector<int64_t>& r,
                                                  const std::vector<int64_t>& c, const std::vector<int64_t>& s,
                                                  int64_t H, int64_t S, bool rope_first, bool interleave) {
  std::vector<int64_t> out = r;
  out.back() = a.back() + r.back();
  return {out};
}

std::vector<std::vector<int64_t>> RopeConcatBackwardShape(const std::vector<int64_t>& d,
                                                          const std::vector<int64_t>& c,
                                                          const std::vector<int64_t>& s, int64_t Da, int64_t H,
                                                          int64_t S, bool rope_first, bool interleave) {
  std::vector<int64_t> sa = d, sr = d;
  sa.back() = Da;
  sr.back() = d.back() - Da;
  return {sa, sr};
}

std::vector<std::vector<int64_t>> RmsNormShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) n *= x[i];
  return {x, {n}};
}

std::vector<std::vector<int64_t>> RmsNormBackwardShape(const std::vector<int64_t>& x,
                                                       const std::vector<int64_t>& w,
                                                       const std::vector<int64_t>& r,
                                                       const std::vector<int64_t>& dy) {
  return {x, w};
}

std::vector<paddle::DataType> TwoFloat32(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32};
}

std::vector<paddle::DataType> TwoFloat32Of4(const paddle::DataType&,
                                            const paddle::DataType&,
                                            const paddle::DataType&,
                                            const paddle::DataType&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32};
}


namespace {
// The indices of the k largest of v[0..n) in the order torch's CPU top-k (HF's router) returns
// them, ties included: the same std::partial_sort (k * 64 <= n) or std::nth_element + std::sort of
// the first k - 1 on (value, index) pairs with the same comparator, so a tie goes to the same index.
// Paddle's CPU top-k is the same but for taking partial_sort only when k * 64 < n; ops.topk (the
// Paddle-op form's top-k) makes it torch's at n = 64 k (ops/selection.py).
void TorchTopkOrder(const float* v, int64_t n, int64_t k, std::vector<std::pair<float, int64_t>>& pairs,
                     int64_t* out) {
  pairs.clear();
  for (int64_t j = 0; j < n; ++j) pairs.emplace_back(v[j], j);
  auto larger = [](const std::pair<float, int64_t>& l, const std::pair<float, int64_t>& r) {
    return (std::isnan(static_cast<double>(l.first)) && !std::isnan(static_cast<double>(r.first))) ||
           (l.first > r.first);
  };
  if (k * 64 <= n) {
    std::partial_sort(pairs.begin(), pairs.begin() + k, pairs.end(), larger);
  } else {
    std::nth_element(pairs.begin(), pairs.begin() + k - 1, pairs.end(), larger);
    std::sort(pairs.begin(), pairs.begin() + k - 1, larger);
  }
  for (int64_t j = 0; j < k; ++j) out[j] = pairs[j].second;
}
}  // namespace

// The MoE router's choice (sigmoid scores -> experts) for rows of scores [N, E] (the sigmoid of the
// router logits) with the selection bias [E]: DeepSeek-V3's noaux_tc. choice = scores + bias; with
// n_group > 1 each group scores the sum of its two largest choices, the topk_group best groups
// stay and the others' experts are out; then the top_k experts by choice, and their weights are
// the scores (not the choices), divided by their sum + 1e-20 when `norm`, times `scaling`.
// -> (weights [N, K] fp32, expert ids [N, K] int64) in the order torch's sorted top-k gives (ties
// too: `TorchTopkOrder`), as the Paddle-op form of ops/router.py routes. HF's router chooses the
// same experts; its top-k is unsorted, so its normalising sum adds them in another order (weights
// 1-2 ulp apart in some rows).
std::vector<paddle::Tensor> RouterTopk(const paddle::Tensor& scores, const paddle::Tensor& bias, int64_t n_group,
                                       int64_t topk_group, int64_t top_k, bool norm, float scaling) {
  const int64_t N = scores.shape()[0], E = scores.shape()[1];
  PD_CHECK(bias.numel() == E && n_group > 0 && E % n_group == 0 && top_k <= E && topk_group <= n_group &&
               (n_group == 1 || E / n_group >= 2),
           "router top-k: ", E, " experts, ", n_group, " groups, top ", topk_group, " groups, top ", top_k);
  auto weights = paddle::empty({N, top_k}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto ids = paddle::empty({N, top_k}, paddle::DataType::INT64, paddle::CPUPlace());
  const float* sp = scores.data<float>();
  const float* bp = bias.data<float>();
  float* wp = weights.data<float>();
  int64_t* ip = ids.data<int64_t>();
  const int64_t per = E / n_group;
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (int64_t r = 0; r < N; ++r) {
    std::vector<float> choice(E), group(n_group);
    std::vector<std::pair<float, int64_t>> pairs;
    std::vector<int64_t> best(std::max<int64_t>(top_k, std::max<int64_t>(topk_group, 2)));
    pairs.reserve(E);
    const float* s = sp + r * E;
    for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + bp[e];
    if (n_group > 1) {
      for (int64_t g = 0; g < n_group; ++g) {  // the sum of the group's top-2, in top-k order
        TorchTopkOrder(choice.data() + g * per, per, 2, pairs, best.data());
        group[g] = choice[g * per + best[0]] + choice[g * per + best[1]];
      }
      TorchTopkOrder(group.data(), n_group, topk_group, pairs, best.data());
      std::vector<char> keep(n_group, 0);
      for (int64_t j = 0; j < topk_group; ++j) keep[best[j]] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) choice[e] = ninf;
    }
    int64_t* id = ip + r * top_k;
    TorchTopkOrder(choice.data(), E, top_k, pairs, id);
    float* w = wp + r * top_k;
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      w[j] = s[id[j]];
      sum += w[j];
    }
    const float denom = sum + 1e-20f;
    for (int64_t j = 0; j < top_k; ++j) w[j] = (norm ? w[j] / denom : w[j]) * scaling;
  }
  return {weights, ids};
}

std::vector<std::vector<int64_t>> RouterTopkShape(const std::vector<int64_t>& s, const std::vector<int64_t>& b,
                                                  int64_t n_group, int64_t topk_group, int64_t top_k, bool norm,
                                                  float scaling) {
  return {{s[0], top_k}, {s[0], top_k}};
}

std::vector<paddle::DataType> RouterTopkDtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32, paddle::DataType::INT64};
}

#ifdef GLM_WITH_MKL
// MKL's CBLAS (libmklml_intel, shipped with Paddle and used by its own CPU matmul).
extern "C" void cblas_sgemm(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c,
                            int ldc);
namespace {
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

void CheckGroups(const std::vector<int64_t>& counts, int64_t rows, int64_t experts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  PD_CHECK(static_cast<int64_t>(counts.size()) == experts,
           "grouped matmul: ", counts.size(), " group sizes for ", experts, " weight matrices");
  PD_CHECK(total == rows, "grouped matmul: group sizes sum to ", total, " but x has ", rows, " rows");
}
}  // namespace

// The routed experts' matmuls in one op: rows of x [A, K] sorted by expert, counts[e] of them
// for expert e, each group times its own w[e] [K, N] -> y [A, N]. One MKL sgemm per non-empty
// group, written in place into y, on the experts' own weight tensors: no per-expert Python,
// slices, stacking or concatenation.
std::vector<paddle::Tensor> GroupedMatmul(const paddle::Tensor& x, const std::vector<paddle::Tensor>& w,
                                          const std::vector<int64_t>& counts) {
  const int64_t A = x.shape()[0], K = x.shape()[1], E = w.size();
  CheckGroups(counts, A, E);
  const int64_t N = E ? w[0].shape()[1] : 0;
  auto y = paddle::empty({A, N}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    PD_CHECK(w[e].shape()[0] == K && w[e].shape()[1] == N, "grouped matmul: weight ", e, " is not [", K, ", ", N, "]");
    const int64_t n = counts[e];
    if (n > 0)
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, n, N, K, 1.0f, xp + row * K, K, w[e].data<float>(), N,
                  0.0f, yp + row * N, N);
    row += n;
  }
  return {y};
}

// Its backward: dx[group e] = dy[group e] w[e]^T, dw[e] = x[group e]^T dy[group e] (0 if empty),
// dw written into the caller's buffers dw [K, N] each (Paddle's dygraph takes a list output only
// in place).
std::vector<paddle::Tensor> GroupedMatmulBackward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& w,
                                                  const paddle::Tensor& dy, std::vector<paddle::Tensor>& dws,
                                                  const std::vector<int64_t>& counts) {
  const int64_t A = x.shape()[0], K = x.shape()[1], E = w.size();
  CheckGroups(counts, A, E);
  const int64_t N = dy.shape()[1];
  PD_CHECK(static_cast<int64_t>(dws.size()) == E, "grouped matmul: ", dws.size(), " gradient buffers for ", E, " weights");
  auto dx = paddle::empty({A, K}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const float* gp = dy.data<float>();
  float* dxp = dx.data<float>();
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    paddle::Tensor& dw = dws[e];
    PD_CHECK(dw.numel() == K * N, "grouped matmul: gradient buffer ", e, " is not [", K, ", ", N, "]");
    const int64_t n = counts[e];
    if (n > 0) {
      cblas_sgemm(kRowMajor, kNoTrans, kTrans, n, K, N, 1.0f, gp + row * N, N, w[e].data<float>(), N,
                  0.0f, dxp + row * K, K);
      cblas_sgemm(kRowMajor, kTrans, kNoTrans, K, N, n, 1.0f, xp + row * K, K, gp + row * N, N,
                  0.0f, dw.data<float>(), N);
    } else {
      std::memset(dw.data<float>(), 0, sizeof(float) * K * N);
    }
    row += n;
  }
  return {dx};
}

std::vector<std::vector<int64_t>> GroupedMatmulShape(const std::vector<int64_t>& x,
                                                     const std::vector<std::vector<int64_t>>& w,
                                                     const std::vector<int64_t>& counts) {
  return {{x[0], w.empty() ? 0 : w[0][1]}};
}

std::vector<std::vector<int64_t>> GroupedMatmulBackwardShape(const std::vector<int64_t>& x,
                                                             const std::vector<std::vector<int64_t>>& w,
                                                             const std::vector<int64_t>& dy,
                                                             const std::vector<std::vector<int64_t>>& dws,
                                                             const std::vector<int64_t>& counts) {
  return {x};
}
// Per-head matmul on a head-major activation: out[n, h, :] = a[n, h, :Din] @ w[h] for a [N, H, D]
// (D >= Din: only each head's first Din columns are read) and w [H, Din, Dout] -> out [N, H, Dout].
// One strided MKL sgemm per head, no transposes or copies (MLA's W_uv on the latent output); the
// heads are split over the threads (MKL runs single-threaded inside a parallel region).
std::vector<paddle::Tensor> HeadMatmul(const paddle::Tensor& a, const paddle::Tensor& w) {
  const int64_t N = a.shape()[0], H = a.shape()[1], D = a.shape()[2];
  const int64_t Din = w.shape()[1], Dout = w.shape()[2];
  PD_CHECK(w.shape()[0] == H && Din <= D, "head matmul: weight [", w.shape()[0], ", ", Din, ", ", Dout,
           "] for activation [", N, ", ", H, ", ", D, "]");
  auto out = paddle::empty({N, H, Dout}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* ap = a.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for schedule(static) if (N * H * Dout >= kParallelMin)
  for (int64_t h = 0; h < H; ++h)
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, N, Dout, Din, 1.0f, ap + h * D, H * D, wp + h * Din * Dout, Dout,
                0.0f, op + h * Dout, H * Dout);
  return {out};
}

// Its backward: da[n, h, :Din] = dout[n, h, :] @ w[h]^T (columns Din.. of each head get 0),
// dw[h] = a[:, h, :Din]^T @ dout[:, h, :].
std::vector<paddle::Tensor> HeadMatmulBackward(const paddle::Tensor& a, const paddle::Tensor& w,
                                               const paddle::Tensor& dout) {
  const int64_t N = a.shape()[0], H = a.shape()[1], D = a.shape()[2];
  const int64_t Din = w.shape()[1], Dout = w.shape()[2];
  auto da = paddle::empty({N, H, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto dw = paddle::empty({H, Din, Dout}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* ap = a.data<float>();
  const float* wp = w.data<float>();
  const float* gp = dout.data<float>();
  float* dap = da.data<float>();
  if (Din < D) {
#pragma omp parallel for schedule(static) if (N * H * D >= kParallelMin)
    for (int64_t nh = 0; nh < N * H; ++nh) std::memset(dap + nh * D + Din, 0, sizeof(float) * (D - Din));
  }
#pragma omp parallel for schedule(static) if (N * H * Dout >= kParallelMin)
  for (int64_t h = 0; h < H; ++h) {
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, N, Din, Dout, 1.0f, gp + h * Dout, H * Dout, wp + h * Din * Dout,
                Dout, 0.0f, dap + h * D, H * D);
    cblas_sgemm(kRowMajor, kTrans, kNoTrans, Din, Dout, N, 1.0f, ap + h * D, H * D, gp + h * Dout, H * Dout,
                0.0f, dw.data<float>() + h * Din * Dout, Dout);
  }
  return {da, dw};
}

std::vector<std::vector<int64_t>> HeadMatmulShape(const std::vector<int64_t>& a, const std::vector<int64_t>& w) {
  return {{a[0], a[1], w[2]}};
}

std::vector<std::vector<int64_t>> HeadMatmulBackwardShape(const std::vector<int64_t>& a,
                                                          const std::vector<int64_t>& w,
                                                          const std::vector<int64_t>& dout) {
  return {a, w};
}

// The routed experts for a few tokens, read straight from the router's choice: x [N, Hd], expert
// ids [N, K] int64 and weights [N, K] -> out [N, Hd], out[t] = sum over t's experts in ascending id
// order of w * down_e(silu(gate_e(x[t])) * up_e(x[t])), each term rounded and added as HF's
// per-expert `index_add_` adds it (the weight applied after the down projection). Each assignment
// streams its expert's weights once (one-row GEMMs), so this is for decoding, where a step has
// at most about as many assignments as experts; no sort, no counts read back, no per-expert
// Python (the grouped matmuls serve larger batches).
std::vector<paddle::Tensor> RoutedRows(const paddle::Tensor& x, const paddle::Tensor& ids,
                                       const paddle::Tensor& weights, const std::vector<paddle::Tensor>& up_gate,
                                       const std::vector<paddle::Tensor>& down) {
  const int64_t N = x.shape()[0], Hd = x.shape()[1], K = ids.shape()[1], E = up_gate.size();
  PD_CHECK(static_cast<int64_t>(down.size()) == E && ids.shape()[0] == N && weights.numel() == N * K,
           "routed rows: ", E, " up_gate / ", down.size(), " down weights, ids [", ids.shape()[0], ", ", K, "]");
  const int64_t I = E ? up_gate[0].shape()[1] / 2 : 0;
  for (int64_t e = 0; e < E; ++e)
    PD_CHECK(up_gate[e].shape()[0] == Hd && up_gate[e].shape()[1] == 2 * I && down[e].shape()[0] == I &&
                 down[e].shape()[1] == Hd,
             "routed rows: expert ", e, " weights are not [", Hd, ", ", 2 * I, "] and [", I, ", ", Hd, "]");
  auto out = paddle::empty({N, Hd}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>();
  const int64_t* ip = ids.data<int64_t>();
  const float* wp = weights.data<float>();
  float* op = out.data<float>();
  for (int64_t i = 0; i < N * K; ++i) PD_CHECK(ip[i] >= 0 && ip[i] < E, "routed rows: expert id ", ip[i], " of ", E);
#pragma omp parallel for schedule(static) if (N * K * I * Hd >= (1 << 22))
  for (int64_t t = 0; t < N; ++t) {
    std::vector<float> h(2 * I), act(I), y(Hd);
    std::vector<int64_t> order(K);
    for (int64_t j = 0; j < K; ++j) order[j] = j;
    const int64_t* id = ip + t * K;
    std::sort(order.begin(), order.end(), [id](int64_t a, int64_t b) { return id[a] < id[b]; });
    float* o = op + t * Hd;
    std::memset(o, 0, sizeof(float) * Hd);
    for (int64_t j : order) {
      const int64_t e = id[j];
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, 1, 2 * I, Hd, 1.0f, xp + t * Hd, Hd, up_gate[e].data<float>(),
                  2 * I, 0.0f, h.data(), 2 * I);
      for (int64_t c = 0; c < I; ++c) act[c] = h[c] / (1.0f + exp_f32(-h[c])) * h[I + c];
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, 1, Hd, I, 1.0f, act.data(), I, down[e].data<float>(), Hd, 0.0f,
                  y.data(), Hd);
      const float w = wp[t * K + j];
      for (int64_t c = 0; c < Hd; ++c) o[c] += y[c] * w;
    }
  }
  return {out};
}

std::vector<std::vector<int64_t>> RoutedRowsShape(const std::vector<int64_t>& x, const std::vector<int64_t>& ids,
                                                  const std::vector<int64_t>& w,
                                                  const std::vector<std::vector<int64_t>>& up_gate,
                                                  const std::vector<std::vector<int64_t>>& down) {
  return {x};
}

// Per-head GEMMs on tiles of head-interleaved activations [B, S, H, d] (what the projections
// produce: no transposes to head-major, no copies of key prefixes), for the per-head dense
// attention's query chunks (modeling/attention_forms.py): one strided MKL sgemm per head of the
// tile, the heads split over the threads.
//
// Heads run on threads of their own (each sgemm single-threaded) when there are enough of them to
// share out evenly; otherwise one after the other, each sgemm on MKL's threads.
inline bool HeadsOnThreads(int64_t heads, int64_t work) {
  return heads >= 2 * omp_get_max_threads() && work >= (1 << 20);
}

// HeadScores: s[g, i, j] = alpha * x[b, r0 + i, h0 + g, :] . y[b, j, h0 + g, :] for i < r1 - r0,
// j < n, g < h1 - h0 -> s [h1 - h0, r1 - r0, n].
std::vector<paddle::Tensor> HeadScores(const paddle::Tensor& x, const paddle::Tensor& y, int64_t b, int64_t r0,
                                       int64_t r1, int64_t n, int64_t h0, int64_t h1, float alpha) {
  const int64_t S = x.shape()[1], H = x.shape()[2], d = x.shape()[3], T = y.shape()[1];
  PD_CHECK(y.shape()[2] == H && y.shape()[3] == d && b < x.shape()[0] && b < y.shape()[0] && 0 <= r0 && r0 < r1 &&
               r1 <= S && 0 < n && n <= T && 0 <= h0 && h0 < h1 && h1 <= H,
           "head scores: tile b ", b, " rows [", r0, ", ", r1, ") keys ", n, " heads [", h0, ", ", h1, ")");
  const int64_t M = r1 - r0, G = h1 - h0;
  auto s = paddle::empty({G, M, n}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* xp = x.data<float>() + ((b * S + r0) * H + h0) * d;
  const float* yp = y.data<float>() + (b * T * H + h0) * d;
  float* sp = s.data<float>();
#pragma omp parallel for schedule(static) if (HeadsOnThreads(G, G * M * n * d))
  for (int64_t g = 0; g < G; ++g)
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, M, n, d, alpha, xp + g * d, H * d, yp + g * d, H * d, 0.0f,
                sp + g * M * n, n);
  return {s};
}

// HeadContext: out[b, r0 + i, h0 + g, :] = alpha * p[g, i, :] @ y[b, :n, h0 + g, :], written in place
// into out [B, S, H, dy] (p [G, M, n]).
void HeadContext(const paddle::Tensor& p, const paddle::Tensor& y, paddle::Tensor& out, int64_t b, int64_t r0,
                 int64_t h0, float alpha) {
  const int64_t G = p.shape()[0], M = p.shape()[1], n = p.shape()[2];
  const int64_t T = y.shape()[1], H = y.shape()[2], dy = y.shape()[3], S = out.shape()[1];
  PD_CHECK(out.shape()[2] == H && out.shape()[3] == dy && n <= T && r0 + M <= S && h0 + G <= H &&
               b < y.shape()[0] && b < out.shape()[0],
           "head context: p [", G, ", ", M, ", ", n, "] at b ", b, " row ", r0, " head ", h0);
  const float* pp = p.data<float>();
  const float* yp = y.data<float>() + (b * T * H + h0) * dy;
  float* op = out.data<float>() + ((b * S + r0) * H + h0) * dy;
#pragma omp parallel for schedule(static) if (HeadsOnThreads(G, G * M * n * dy))
  for (int64_t g = 0; g < G; ++g)
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, M, dy, n, alpha, pp + g * M * n, n, yp + g * dy, H * dy, 0.0f,
                op + g * dy, H * dy);
}

// HeadAccum: z[b, j, h0 + g, :] += alpha * sum_i p[g, i, j] x[b, r0 + i, h0 + g, :] for j < n, in
// place into z [B, T, H, d] (p [G, M, n]): the key / value gradients of a query chunk.
void HeadAccum(const paddle::Tensor& p, const paddle::Tensor& x, paddle::Tensor& z, int64_t b, int64_t r0,
               int64_t h0, float alpha) {
  const int64_t G = p.shape()[0], M = p.shape()[1], n = p.shape()[2];
  const int64_t S = x.shape()[1], H = x.shape()[2], d = x.shape()[3], T = z.shape()[1];
  PD_CHECK(z.shape()[2] == H && z.shape()[3] == d && n <= T && r0 + M <= S && h0 + G <= H && b < x.shape()[0] &&
               b < z.shape()[0],
           "head accum: p [", G, ", ", M, ", ", n, "] at b ", b, " row ", r0, " head ", h0);
  const float* pp = p.data<float>();
  const float* xp = x.data<float>() + ((b * S + r0) * H + h0) * d;
  float* zp = z.data<float>() + (b * T * H + h0) * d;
#pragma omp parallel for schedule(static) if (HeadsOnThreads(G, G * M * n * d))
  for (int64_t g = 0; g < G; ++g)
    cblas_sgemm(kRowMajor, kTrans, kNoTrans, n, d, M, alpha, pp + g * M * n, n, xp + g * d, H * d, 1.0f, zp + g * d,
                H * d);
}

std::vector<std::vector<int64_t>> HeadScoresShape(const std::vector<int64_t>& x, const std::vector<int64_t>& y,
                                                  int64_t b, int64_t r0, int64_t r1, int64_t n, int64_t h0,
                                                  int64_t h1, float alpha) {
  return {{h1 - h0, r1 - r0, n}};
}
#endif  // GLM_WITH_MKL

// Names must not end in "_grad" (Paddle reserves that suffix for registered gradient ops). Paddle's
// build reads the op names from this file's text, so each registration spells out Paddle's macro.
// An op that makes new tensors names its kernel with the functions giving their shapes and dtypes:
#define GLM_KERNEL(KERNEL, SHAPE, DTYPE) \
  SetKernelFn(PD_KERNEL(KERNEL)).SetInferShapeFn(PD_INFER_SHAPE(SHAPE)).SetInferDtypeFn(PD_INFER_DTYPE(DTYPE))

PD_BUILD_OP(glm_masked_softmax)
    .Inputs({"S", "Mask"}).Outputs({"Out"}).SetInplaceMap({{"S", "Out"}})
    .SetKernelFn(PD_KERNEL(MaskedSoftmax));

PD_BUILD_OP(glm_softmax_backward)
    .Inputs({"P", "DP"}).Outputs({"DS"}).SetInplaceMap({{"DP", "DS"}})
    .SetKernelFn(PD_KERNEL(SoftmaxBackward));

PD_BUILD_OP(glm_rms_norm)
    .Inputs({"X", "W"}).Outputs({"Y", "R"}).Attrs({"eps: float"})
    .GLM_KERNEL(RmsNorm, RmsNormShape, TwoFloat32);

PD_BUILD_OP(glm_rms_norm_backward)
    .Inputs({"X", "W", "R", "DY"}).Outputs({"DX", "DW"})
    .GLM_KERNEL(RmsNormBackward, RmsNormBackwardShape, TwoFloat32Of4);

PD_BUILD_OP(glm_topk_tables)
    .Inputs({"TopK"}).Outputs({"Rows", "Mask", "HasKey"}).Attrs({"S: int64_t"})
    .GLM_KERNEL(TopkTables, TopkTablesShape, TopkTablesDtype);

PD_BUILD_OP(glm_selection_mask)
    .Inputs({"Sel"}).Outputs({"Mask"}).Attrs({"width: int64_t", "fill: float", "mean_col: bool"})
    .GLM_KERNEL(SelectionMask, SelectionMaskShape, OneFloat32Of1);

PD_BUILD_OP(glm_rope_concat)
    .Inputs({"A", "R", "Cos", "Sin"}).Outputs({"Out"})
    .Attrs({"H: int64_t", "S: int64_t", "rope_first: bool", "interleave: bool"})
    .GLM_KERNEL(RopeConcat, RopeConcatShape, OneFloat32Of4);

PD_BUILD_OP(glm_rope_concat_backward)
    .Inputs({"DOut", "Cos", "Sin"}).Outputs({"DA", "DR"})
    .Attrs({"Da: int64_t", "H: int64_t", "S: int64_t", "rope_first: bool", "interleave: bool"})
    .GLM_KERNEL(RopeConcatBackward, RopeConcatBackwardShape, TwoFloat32Of3In);

PD_BUILD_OP(glm_cross_entropy)
    .Inputs({"Logits", "Target"}).Outputs({"Loss", "LSE"}).Attrs({"ignore_index: int64_t"})
    .GLM_KERNEL(CrossEntropy, CrossEntropyShape, TwoFloat32);

PD_BUILD_OP(glm_cross_entropy_backward)
    .Inputs({"Logits", "Target", "LSE", "G"}).Outputs({"DLogits"}).Attrs({"ignore_index: int64_t"})
    .GLM_KERNEL(CrossEntropyBackward, CrossEntropyBackwardShape, OneFloat32Of4);

PD_BUILD_OP(glm_swiglu)
    .Inputs({"H", "Scale"}).Outputs({"Act"})
    .GLM_KERNEL(Swiglu, SwigluShape, OneFloat32Of2);

PD_BUILD_OP(glm_swiglu_backward)
    .Inputs({"H", "Scale", "DAct"}).Outputs({"DH", "DScale"})
    .GLM_KERNEL(SwigluBackward, SwigluBackwardShape, TwoFloat32Of3In);

PD_BUILD_OP(glm_router_topk)
    .Inputs({"Scores", "Bias"}).Outputs({"Weights", "Ids"})
    .Attrs({"n_group: int64_t", "topk_group: int64_t", "top_k: int64_t", "norm: bool", "scaling: float"})
    .GLM_KERNEL(RouterTopk, RouterTopkShape, RouterTopkDtype);

#ifdef GLM_WITH_MKL
PD_BUILD_OP(glm_routed_rows)
    .Inputs({"X", "Ids", "Weights", paddle::Vec("UpGate"), paddle::Vec("Down")}).Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(RoutedRows)).SetInferShapeFn(PD_INFER_SHAPE(RoutedRowsShape));

PD_BUILD_OP(glm_grouped_matmul)
    .Inputs({"X", paddle::Vec("W")}).Outputs({"Y"}).Attrs({"counts: std::vector<int64_t>"})
    .SetKernelFn(PD_KERNEL(GroupedMatmul)).SetInferShapeFn(PD_INFER_SHAPE(GroupedMatmulShape));

PD_BUILD_OP(glm_grouped_matmul_backward)
    .Inputs({"X", paddle::Vec("W"), "DY", paddle::Vec("DWBuf")}).Outputs({"DX", paddle::Vec("DW")})
    .SetInplaceMap({{paddle::Vec("DWBuf"), paddle::Vec("DW")}}).Attrs({"counts: std::vector<int64_t>"})
    .SetKernelFn(PD_KERNEL(GroupedMatmulBackward)).SetInferShapeFn(PD_INFER_SHAPE(GroupedMatmulBackwardShape));

PD_BUILD_OP(glm_head_scores)
    .Inputs({"X", "Y"}).Outputs({"S"})
    .Attrs({"b: int64_t", "r0: int64_t", "r1: int64_t", "n: int64_t", "h0: int64_t", "h1: int64_t", "alpha: float"})
    .GLM_KERNEL(HeadScores, HeadScoresShape, OneFloat32Of2);

PD_BUILD_OP(glm_head_context)
    .Inputs({"P", "Y", "Out"}).Outputs({"OutOut"}).SetInplaceMap({{"Out", "OutOut"}})
    .Attrs({"b: int64_t", "r0: int64_t", "h0: int64_t", "alpha: float"})
    .SetKernelFn(PD_KERNEL(HeadContext));

PD_BUILD_OP(glm_head_accum)
    .Inputs({"P", "X", "Z"}).Outputs({"ZOut"}).SetInplaceMap({{"Z", "ZOut"}})
    .Attrs({"b: int64_t", "r0: int64_t", "h0: int64_t", "alpha: float"})
    .SetKernelFn(PD_KERNEL(HeadAccum));

PD_BUILD_OP(glm_head_matmul)
    .Inputs({"A", "W"}).Outputs({"Out"})
    .GLM_KERNEL(HeadMatmul, HeadMatmulShape, OneFloat32Of2);

PD_BUILD_OP(glm_head_matmul_backward)
    .Inputs({"A", "W", "DOut"}).Outputs({"DA", "DW"})
    .GLM_KERNEL(HeadMatmulBackward, HeadMatmulBackwardShape, TwoFloat32Of3In);
#endif

// ------------------------------------------------------------------------------ checkpoint copies
// Cache-blocked 2-D transposes for the checkpoint load (HF [out, in] -> Paddle [in, out]). Nearly
// every GLM weight is transposed on load, and numpy copies a transpose element by element through
// strided memory: for 2-byte elements a few hundred MB/s. These move 8 x 8 blocks of 16-bit values
// (4 x 4 of 32-bit ones) through SSE2 registers inside 64 x 64 tiles (cache-resident on both
// sides), with a scalar loop for the edges and for machines without SSE2; bf16 -> fp32 widening
// (the bits shifted into the high half) happens in the same pass. Plain C entry points on raw
// numpy buffers, called through ctypes (ops/transpose.py), which releases the GIL, so the loader's
// thread pool runs row chunks in parallel.

#if defined(__SSE2__)
#include <emmintrin.h>
#define GLM_HAVE_SSE2 1
#define GLM_VEC __m128i
#else
struct GlmNoVector {};  // without SSE2 the tile loops run the scalar edges only
#define GLM_VEC GlmNoVector
#endif
#define GLM_TILE 64
#define GLM_MIN(a, b) ((a) < (b) ? (a) : (b))

/* dst[c * ldd + r] = f(src[r * lds + c]) for r in [r0, r1), c in [c0, c1) (strides in elements) */
#define EDGE(NAME, S, D, F) \
static void NAME(const S *src, D *dst, size_t r0, size_t r1, size_t c0, size_t c1, size_t lds, size_t ldd) { \
  for (size_t r = r0; r < r1; ++r) { \
    const S *s = src + r * lds; \
    for (size_t c = c0; c < c1; ++c) dst[c * ldd + r] = F(s[c]); \
  } \
}
#define SAME(x) (x)
#define WIDEN(x) (((uint32_t)(x)) << 16)
EDGE(edge16, uint16_t, uint16_t, SAME)
EDGE(edge16w, uint16_t, uint32_t, WIDEN)
EDGE(edge32, uint32_t, uint32_t, SAME)
EDGE(edge64, uint64_t, uint64_t, SAME)

#ifdef GLM_HAVE_SSE2
/* rows s[0], s[lds], ... s[7 * lds] (8 values each) -> o[i] = column i */
static inline void t8x8(const uint16_t *s, size_t lds, __m128i o[8]) {
  __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * lds));
  __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * lds));
  __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * lds));
  __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * lds));
  __m128i a4 = _mm_loadu_si128((const __m128i *)(s + 4 * lds));
  __m128i a5 = _mm_loadu_si128((const __m128i *)(s + 5 * lds));
  __m128i a6 = _mm_loadu_si128((const __m128i *)(s + 6 * lds));
  __m128i a7 = _mm_loadu_si128((const __m128i *)(s + 7 * lds));
  __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
  __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
  __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
  __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
  __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
  __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
  __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
  __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
  o[0] = _mm_unpacklo_epi64(c0, c4); o[1] = _mm_unpackhi_epi64(c0, c4);
  o[2] = _mm_unpacklo_epi64(c1, c5); o[3] = _mm_unpackhi_epi64(c1, c5);
  o[4] = _mm_unpacklo_epi64(c2, c6); o[5] = _mm_unpackhi_epi64(c2, c6);
  o[6] = _mm_unpacklo_epi64(c3, c7); o[7] = _mm_unpackhi_epi64(c3, c7);
}
#endif

namespace {
// The transposes' one tile loop over [rows, cols] in GLM_TILE x GLM_TILE tiles: B x B register blocks of
// [r0, rv) x [c0, cv) by `block(s, lds, d, ldd)` (none where B = 0 or without SSE2), the edges
// [r0, rv) x [cv, c1) and [rv, r1) x [c0, c1) by `edge`: every element exactly once.
template <size_t B, class S, class D, class Block, class Edge>
void transpose_tiles(const S *src, D *dst, size_t rows, size_t cols, size_t lds, size_t ldd, Block block, Edge edge) {
  for (size_t r0 = 0; r0 < rows; r0 += GLM_TILE) {
    size_t r1 = GLM_MIN(r0 + GLM_TILE, rows);
    for (size_t c0 = 0; c0 < cols; c0 += GLM_TILE) {
      size_t c1 = GLM_MIN(c0 + GLM_TILE, cols), rv = r0, cv = c0;
#ifdef GLM_HAVE_SSE2
      if constexpr (B > 0) {
        rv = r0 + (r1 - r0) / B * B;
        cv = c0 + (c1 - c0) / B * B;
        for (size_t r = r0; r < rv; r += B)
          for (size_t c = c0; c < cv; c += B) block(src + r * lds + c, lds, dst + c * ldd + r, ldd);
      }
#endif
      edge(src, dst, r0, rv, cv, c1, lds, ldd);
      edge(src, dst, rv, r1, c0, c1, lds, ldd);
    }
  }
}

void no_block(const void *, size_t, void *, size_t) {}

// The 16-bit transposes: 8 x 8 blocks through t8x8, whose 8 columns `o` `store(d, o, ldd)` writes (as 16
// bits, or widened to 32).
template <class D, class Store, class Edge>
void transpose16(const uint16_t *src, D *dst, size_t rows, size_t cols, size_t lds, size_t ldd, Store store,
                 Edge edge) {
  auto block = [store](const uint16_t *s, size_t lds, D *d, size_t ldd) {
#ifdef GLM_HAVE_SSE2
    __m128i o[8];
    t8x8(s, lds, o);
    store(d, o, ldd);
#endif
  };
  transpose_tiles<8>(src, dst, rows, cols, lds, ldd, block, edge);
}
}  // namespace

extern "C" void glm52_transpose16(const uint16_t *src, uint16_t *dst, size_t rows, size_t cols, size_t lds,
                                  size_t ldd) {
  transpose16(
      src, dst, rows, cols, lds, ldd,
      [](uint16_t *d, const GLM_VEC *o, size_t ldd) {
#ifdef GLM_HAVE_SSE2
        for (int i = 0; i < 8; ++i) _mm_storeu_si128((__m128i *)(d + i * ldd), o[i]);
#endif
      },
      edge16);
}

extern "C" void glm52_transpose_bf16_f32(const uint16_t *src, uint32_t *dst, size_t rows, size_t cols, size_t lds,
                                         size_t ldd) {
  transpose16(
      src, dst, rows, cols, lds, ldd,
      [](uint32_t *d, const GLM_VEC *o, size_t ldd) {
#ifdef GLM_HAVE_SSE2
        const __m128i zero = _mm_setzero_si128();
        for (int i = 0; i < 8; ++i) {  // zero low halves: bf16 bits become the fp32's high half
          _mm_storeu_si128((__m128i *)(d + i * ldd), _mm_unpacklo_epi16(zero, o[i]));
          _mm_storeu_si128((__m128i *)(d + i * ldd + 4), _mm_unpackhi_epi16(zero, o[i]));
        }
#endif
      },
      edge16w);
}

extern "C" void glm52_transpose32(const uint32_t *src, uint32_t *dst, size_t rows, size_t cols, size_t lds, size_t ldd) {
  transpose_tiles<4>(
      src, dst, rows, cols, lds, ldd,
      [](const uint32_t *s, size_t lds, uint32_t *d, size_t ldd) {
#ifdef GLM_HAVE_SSE2
        __m128i a0 = _mm_loadu_si128((const __m128i *)(s + 0 * lds));
        __m128i a1 = _mm_loadu_si128((const __m128i *)(s + 1 * lds));
        __m128i a2 = _mm_loadu_si128((const __m128i *)(s + 2 * lds));
        __m128i a3 = _mm_loadu_si128((const __m128i *)(s + 3 * lds));
        __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpacklo_epi32(a2, a3);
        __m128i t2 = _mm_unpackhi_epi32(a0, a1), t3 = _mm_unpackhi_epi32(a2, a3);
        _mm_storeu_si128((__m128i *)(d + 0 * ldd), _mm_unpacklo_epi64(t0, t1));
        _mm_storeu_si128((__m128i *)(d + 1 * ldd), _mm_unpackhi_epi64(t0, t1));
        _mm_storeu_si128((__m128i *)(d + 2 * ldd), _mm_unpacklo_epi64(t2, t3));
        _mm_storeu_si128((__m128i *)(d + 3 * ldd), _mm_unpackhi_epi64(t2, t3));
#endif
      },
      edge32);
}

extern "C" void glm52_transpose64(const uint64_t *src, uint64_t *dst, size_t rows, size_t cols, size_t lds, size_t ldd) {
  transpose_tiles<0>(src, dst, rows, cols, lds, ldd, no_block, edge64);
}
