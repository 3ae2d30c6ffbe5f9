// specdec::row_attention: scaled dot-product attention whose every output row is computed on its own.
//
//   out[b, h, m, :] = softmax_l(scale * q[b, h, m, :] . k[b, h / rep, l, :] + mask[b, h|0, m, l]) @ v[b, h / rep, l, :]
//
// Row-invariant by construction: each (b, h, m) row runs the same loops in the same order whatever the number of
// rows, their batch or their neighbours, so a row's result depends only on its own query, the cache and its own
// mask row. That is what makes a γ+1-row verification pass, a tree pass or a batched pass give a row exactly the
// logits a one-row pass gives it (library kernels pick other reduction orders for other row counts). A slot whose
// mask is below -FLT_MAX / 2 is skipped: its exp() would be exactly 0, so skipping it (or holes, or a longer
// cache) changes no sum. Built on first use by specdec.runtime.rowwise.
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
    return n == W ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    return at::vec::convert<float>(n == W ? at::vec::Vectorized<T>::loadu(p, W) : at::vec::Vectorized<T>::loadu(p, n));
  }
}

template <typename T>
inline void store_vec(const Vec& x, T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == W) x.store(p); else x.store(p, n);
  } else {
    at::vec::convert<T>(x).store(p, n);
  }
}

// The mask's value at slot l as an additive float: its own dtype read directly (no converted copy per call).
template <typename MT>
inline float mask_at(const MT* row, int64_t l) {
  if constexpr (std::is_same_v<MT, bool>) {
    return row[l] ? 0.f : -std::numeric_limits<float>::infinity();
  } else {
    return static_cast<float>(row[l]);
  }
}

// One (b, kv-head) at a time: each key and value row is loaded once for all the query rows that read it, but
// every query row's own arithmetic (its dot products, max, exp, sum and weighted sum, each over its visible
// slots in slot order) is the same sequence as when it is alone in a pass.
template <typename T, typename MT>
void row_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MT* mp,
                          int64_t mb, int64_t mh, int64_t mm, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2);
  const int64_t rep = H / Hkv;
  const int64_t R = rep * M;  // query rows reading one kv head
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float skip = -0.5f * std::numeric_limits<float>::max();
  const int64_t NV = (D + W - 1) / W;  // vectors per head row; the last holds D - (NV - 1) * W values
  const int64_t tail = D - (NV - 1) * W;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    // per-thread scratch, reused across calls (and reached through plain pointers in the loops below)
    thread_local std::vector<Vec> qv_buf, acc_buf, kv_buf;
    thread_local std::vector<float> scores_buf, stats_buf;
    thread_local std::vector<const void*> masks_buf;
    qv_buf.resize(R * NV); acc_buf.resize(R * NV); kv_buf.resize(NV);
    scores_buf.resize(R * L); stats_buf.resize(2 * R); masks_buf.resize(R);
    Vec* qv = qv_buf.data();
    Vec* acc = acc_buf.data();
    Vec* kv = kv_buf.data();
    float* scores = scores_buf.data();
    float* best = stats_buf.data();
    float* total = best + R;
    const MT** masks = reinterpret_cast<const MT**>(masks_buf.data());
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / Hkv, hk = bk % Hkv;
      const T* kbase = kp + bk * L * D;
      const T* vbase = vp + bk * L * D;
      for (int64_t r = 0; r < R; ++r) {  // row r: head hk * rep + r / M, query m = r % M
        const int64_t h = hk * rep + r / M, m = r % M;
        const T* qr = qp + ((b * H + h) * M + m) * D;
        for (int64_t j = 0; j < NV; ++j) qv[r * NV + j] = load_vec(qr + j * W, j + 1 < NV ? W : tail) * Vec(scale);
        masks[r] = mp ? mp + b * mb + h * mh + m * mm : nullptr;
        best[r] = std::numeric_limits<float>::lowest();
        total[r] = 0.f;
        for (int64_t j = 0; j < NV; ++j) acc[r * NV + j] = Vec(0.f);
      }
      // Slots past the last one any row sees (or before the first) add nothing: the loops below stop there.
      int64_t lo = L, hi = 0;
      for (int64_t r = 0; r < R; ++r) {
        if (!masks[r]) { lo = 0; hi = L; break; }
        int64_t first = 0, last = L;
        while (first < L && mask_at(masks[r], first) <= skip) ++first;
        while (last > first && mask_at(masks[r], last - 1) <= skip) --last;
        lo = std::min(lo, first);
        hi = std::max(hi, last);
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t l = 0; l < L; ++l)
          if (l < lo || l >= hi) scores[r * L + l] = -std::numeric_limits<float>::infinity();
      for (int64_t l = lo; l < hi; ++l) {  // scores: a fixed-order dot product per (row, slot)
        bool loaded = false;
        for (int64_t r = 0; r < R; ++r) {
          const float bias = masks[r] ? mask_at(masks[r], l) : 0.f;
          if (bias <= skip) {  // a masked slot: exp() would be exactly 0
            scores[r * L + l] = -std::numeric_limits<float>::infinity();
            continue;
          }
          if (!loaded) {
            for (int64_t j = 0; j < NV; ++j) kv[j] = load_vec(kbase + l * D + j * W, j + 1 < NV ? W : tail);
            loaded = true;
          }
          Vec s = qv[r * NV] * kv[0];
          for (int64_t j = 1; j < NV; ++j) s = at::vec::fmadd(qv[r * NV + j], kv[j], s);
          const float score = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s) + bias;
          scores[r * L + l] = score;
          best[r] = std::max(best[r], score);
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // exp(score - best) of a row's slots, W at a time (masked: exactly 0)
        float* row = scores + r * L;
        const Vec top(best[r]);
        int64_t l = 0;
        for (; l + W <= L; l += W) (Vec::loadu(row + l) - top).exp_u20().store(row + l);
        if (l < L) (Vec::loadu(row + l, L - l) - top).exp_u20().store(row + l, L - l);
      }
      for (int64_t l = lo; l < hi; ++l) {  // weighted values: each row accumulates its slots in slot order
        bool loaded = false;
        for (int64_t r = 0; r < R; ++r) {
          const float e = scores[r * L + l];
          if (e == 0.f) continue;  // a masked slot, or one whose weight underflowed: adds exactly nothing
          total[r] += e;
          if (!loaded) {
            for (int64_t j = 0; j < NV; ++j) kv[j] = load_vec(vbase + l * D + j * W, j + 1 < NV ? W : tail);
            loaded = true;
          }
          const Vec ev(e);
          for (int64_t j = 0; j < NV; ++j) acc[r * NV + j] = at::vec::fmadd(ev, kv[j], acc[r * NV + j]);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = hk * rep + r / M, m = r % M;
        const Vec inv(total[r] > 0.f ? 1.f / total[r] : 0.f);
        T* orow = op + ((b * H + h) * M + m) * D;
        for (int64_t j = 0; j < NV; ++j) store_vec(acc[r * NV + j] * inv, orow + j * W, j + 1 < NV ? W : tail);
      }
    }
  });
}

template <typename T>
void dispatch_mask(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                   float scale, at::Tensor& out) {
  if (!mask.has_value()) {
    row_attention_kernel<T, float>(q, k, v, nullptr, 0, 0, 0, scale, out);
    return;
  }
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.dim() == 4 && m.size(3) == k.size(2) && m.stride(3) == 1,
              "row_attention: the mask must be [B|1, H|1, M, L] with contiguous slots");
  const int64_t mb = m.size(0) == 1 ? 0 : m.stride(0), mh = m.size(1) == 1 ? 0 : m.stride(1);
  const int64_t mm = m.size(2) == 1 ? 0 : m.stride(2);
  switch (m.scalar_type()) {
    case at::kBool: row_attention_kernel<T, bool>(q, k, v, m.data_ptr<bool>(), mb, mh, mm, scale, out); break;
    case at::kFloat: row_attention_kernel<T, float>(q, k, v, m.data_ptr<float>(), mb, mh, mm, scale, out); break;
    case at::kBFloat16:
      row_attention_kernel<T, at::BFloat16>(q, k, v, m.data_ptr<at::BFloat16>(), mb, mh, mm, scale, out); break;
    case at::kHalf: row_attention_kernel<T, at::Half>(q, k, v, m.data_ptr<at::Half>(), mb, mh, mm, scale, out); break;
    default: TORCH_CHECK(false, "row_attention: a float32, bfloat16, float16 or bool mask, got ", m.scalar_type());
  }
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "row_attention: q, k, v must be [B, H, M|L, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "row_attention: query heads must be a multiple of key heads");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "row_attention: q, k, v must share a dtype");
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {  // float32 arithmetic: float64 stays with PyTorch's kernels
    case at::kFloat: dispatch_mask<float>(qc, kc, vc, mask, s, out); break;
    case at::kBFloat16: dispatch_mask<at::BFloat16>(qc, kc, vc, mask, s, out); break;
    case at::kHalf: dispatch_mask<at::Half>(qc, kc, vc, mask, s, out); break;
    default: TORCH_CHECK(false, "row_attention: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("row_attention", &row_attention); }
