// specdec::row_attention: scaled dot-product attention whose every output row is computed on its own.
//
//   out[b, h, m, :] = softmax_l(scale * q[b, h, m, :] . k[b, h / rep, l, :] + mask[b, h|0, m, l]) @ v[b, h / rep, l, :]
//
// Row-invariant by construction: each (b, h, m) row runs the same loops in the same order whatever the number of
// rows, their batch or their neighbours, so a row's result depends only on its own query, the cache and its own
// mask row. That is what makes a γ+1-row verification pass, a tree pass or a batched pass give a row exactly the
// logits a one-row pass gives it (library kernels pick other reduction orders for other row counts). A slot whose
// mask is below -FLT_MAX / 2 is skipped: its exp() would be exactly 0, so skipping it (or holes, or a longer
// cache) changes no sum. Built on first use by specdec.runtime.attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// n (<= W) elements of T at p as floats, zeros past n
template <typename T>
inline Vec load_vec(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, n);
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, n));
  }
}

template <typename T>
inline void store_vec(const Vec& x, T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    x.store(p, n);
  } else {
    at::vec::convert<T>(x).store(p, n);
  }
}

template <typename T>
void row_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          bool has_mask, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2);
  const int64_t rep = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* mp = has_mask ? mask.data_ptr<float>() : nullptr;
  int64_t mb = 0, mh = 0, mm = 0;
  if (has_mask) {
    mb = mask.size(0) == 1 ? 0 : mask.stride(0);
    mh = mask.size(1) == 1 ? 0 : mask.stride(1);
    mm = mask.size(2) == 1 ? 0 : mask.stride(2);
  }
  const float skip = -0.5f * std::numeric_limits<float>::max();
  const int64_t NV = (D + W - 1) / W;  // vectors per head row; the last holds D - (NV - 1) * W values
  const int64_t tail = D - (NV - 1) * W;
  at::parallel_for(0, B * H * M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(L);
    std::vector<int64_t> live(L);
    std::vector<Vec> qv(NV), acc(NV);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (H * M), h = (row / M) % H, m = row % M, hk = h / rep;
      const T* kbase = kp + (b * Hkv + hk) * L * D;
      const T* vbase = vp + (b * Hkv + hk) * L * D;
      const T* qr = qp + row * D;
      for (int64_t j = 0; j < NV; ++j) qv[j] = load_vec(qr + j * W, j + 1 < NV ? W : tail) * Vec(scale);
      const float* mr = has_mask ? mp + b * mb + h * mh + m * mm : nullptr;
      int64_t n = 0;
      float best = std::numeric_limits<float>::lowest();
      for (int64_t l = 0; l < L; ++l) {
        const float bias = mr ? mr[l] : 0.f;
        if (bias <= skip) continue;  // a masked slot: exp() would be exactly 0
        const T* kr = kbase + l * D;
        Vec s = qv[0] * load_vec(kr, NV > 1 ? W : tail);
        for (int64_t j = 1; j < NV; ++j) s = at::vec::fmadd(qv[j], load_vec(kr + j * W, j + 1 < NV ? W : tail), s);
        const float score = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s) + bias;
        live[n] = l;
        scores[n++] = score;
        best = std::max(best, score);
      }
      for (int64_t j = 0; j < NV; ++j) acc[j] = Vec(0.f);
      float total = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float e = std::exp(scores[i] - best);
        total += e;
        const T* vr = vbase + live[i] * D;
        const Vec ev(e);
        for (int64_t j = 0; j < NV; ++j) acc[j] = at::vec::fmadd(ev, load_vec(vr + j * W, j + 1 < NV ? W : tail), acc[j]);
      }
      const Vec inv(total > 0.f ? 1.f / total : 0.f);
      T* orow = op + row * D;
      for (int64_t j = 0; j < NV; ++j) store_vec(acc[j] * inv, orow + j * W, j + 1 < NV ? W : tail);
    }
  });
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "row_attention: q, k, v must be [B, H, M|L, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "row_attention: query heads must be a multiple of key heads");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "row_attention: q, k, v must share a dtype");
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const bool has_mask = mask.has_value();
  // an additive mask as floats; a boolean one (true = attend) as 0 / -inf
  const auto mf = !has_mask ? at::Tensor()
                  : mask->scalar_type() == at::kBool
                      ? at::where(*mask, 0.f, -std::numeric_limits<float>::infinity()).contiguous()
                      : mask->to(at::kFloat).contiguous();
  TORCH_CHECK(!has_mask || mf.dim() == 4, "row_attention: the mask must be [B, 1|H, M, L]");
  auto out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {  // float32 arithmetic: float64 stays with PyTorch's kernels
    case at::kFloat: row_attention_kernel<float>(qc, kc, vc, mf, has_mask, s, out); break;
    case at::kBFloat16: row_attention_kernel<at::BFloat16>(qc, kc, vc, mf, has_mask, s, out); break;
    case at::kHalf: row_attention_kernel<at::Half>(qc, kc, vc, mf, has_mask, s, out); break;
    default: TORCH_CHECK(false, "row_attention: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("row_attention", &row_attention); }
