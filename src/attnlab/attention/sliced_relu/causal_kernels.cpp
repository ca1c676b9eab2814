// Causal sliced ReLU's work around its dominance sums on the CPU (sliced_relu/causal.py), fused.
//
// Around the sums A, B, C, E (over the keys j <= i below s_i of v, t v, 1 and t) the torch code runs
// the running means, the numerator, the normaliser, three row dot products and a suffix sum as a
// dozen whole passes over (T, D) memory. Here the forward is one pass in time order, the backward one
// pass before its transposed sums (in time order) and one after (in reverse). The running sums are
// kept in double, and vbar_i (the mean of the real v_j, j <= i) is never stored: each pass that needs
// it sums it again as it goes. Plain C++ without torch's headers (attnlab.attention.common.native
// builds it). `real` is null where every token is real; else 1 or 0 per token, the values already
// zeroed at padded tokens, whose outputs and gradients are written 0.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/parallel_rows.h"

namespace {

// out_i = 2 (s_i A_i − B_i − vbar_i (s_i C_i − E_i)) / max(den_i, eps), with
// den_i = Σ_{j≤i} |s_i − t_j| = s_i (2 C_i − n_i) + Σ_{j≤i} t_j − 2 E_i; also den, the ReLU mass
// s_i C_i − E_i and n_i (real keys j <= i, at least 1), which the backward reads.
template <typename T>
void forward_rows(const T* s, const T* t, const T* v, const T* real, const T* sum_v, const T* sum_tv,
                  const T* count, const T* sum_t, double eps, T* out, T* den_out, T* mass_out, T* n_out,
                  int64_t length, int64_t dim, int64_t row_begin, int64_t row_end) {
  std::vector<double> running_v(dim);
  for (int64_t n = row_begin; n < row_end; ++n) {
    std::fill(running_v.begin(), running_v.end(), 0.0);
    double running_n = 0.0, running_t = 0.0;
    for (int64_t i = n * length; i < (n + 1) * length; ++i) {
      const T *vi = v + i * dim, *ai = sum_v + i * dim, *bi = sum_tv + i * dim;
      T* oi = out + i * dim;
      const bool is_real = real == nullptr || real[i] != 0;
      running_n += is_real ? 1.0 : 0.0;
      running_t += t[i];
      const double si = s[i], ci = count[i], ei = sum_t[i];
      const double mass = si * ci - ei, den = si * (2.0 * ci - running_n) + running_t - 2.0 * ei;
      const double n_safe = std::max(running_n, 1.0);
      const double scale = is_real ? 2.0 / std::max(den, eps) : 0.0, mean_scale = mass / n_safe;
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) {
        running_v[c] += vi[c];
        oi[c] = static_cast<T>(scale * (si * ai[c] - bi[c] - running_v[c] * mean_scale));
      }
      den_out[i] = static_cast<T>(den);
      mass_out[i] = static_cast<T>(mass);
      n_out[i] = static_cast<T>(n_safe);
    }
  }
}

// The per-query scalars of the backward, from g = dL/dout: a_scale = 2 / max(den, eps) (a_i = a_scale_i
// g_i = dL/dnum_i), dden = −g·out / max(den, eps) (0 where den < eps), a_vbar = a_scale g·vbar, and
// dL/ds_i = a_scale g·A − C a_vbar + dden (C + C_le − n); all 0 at padded tokens.
template <typename T>
void backward_queries_rows(const T* g, const T* out, const T* v, const T* real, const T* sum_v, const T* den,
                           const T* count, const T* count_le, const T* n_safe, double eps, T* a_scale_out,
                           T* grad_den_out, T* a_vbar_out, T* grad_s_out, int64_t length, int64_t dim,
                           int64_t row_begin, int64_t row_end) {
  std::vector<double> running_v(dim);
  for (int64_t n = row_begin; n < row_end; ++n) {
    std::fill(running_v.begin(), running_v.end(), 0.0);
    for (int64_t i = n * length; i < (n + 1) * length; ++i) {
      const T *gi = g + i * dim, *oi = out + i * dim, *vi = v + i * dim, *ai = sum_v + i * dim;
      double g_out = 0.0, g_running = 0.0, g_sums = 0.0;
#pragma omp simd reduction(+ : g_out, g_running, g_sums)
      for (int64_t c = 0; c < dim; ++c) {
        running_v[c] += vi[c];
        g_out += static_cast<double>(gi[c]) * oi[c];
        g_running += gi[c] * running_v[c];
        g_sums += static_cast<double>(gi[c]) * ai[c];
      }
      const bool is_real = real == nullptr || real[i] != 0;
      const double d = den[i], inv_d = 1.0 / std::max(d, eps);
      const double a_scale = is_real ? 2.0 * inv_d : 0.0;
      const double grad_den = is_real && d >= eps ? -g_out * inv_d : 0.0;
      const double a_vbar = a_scale * g_running / n_safe[i];
      const double c = count[i];
      const double grad_s = a_scale * g_sums - c * a_vbar + grad_den * (c + count_le[i] - n_safe[i]);
      a_scale_out[i] = static_cast<T>(a_scale);
      grad_den_out[i] = static_cast<T>(grad_den);
      a_vbar_out[i] = static_cast<T>(a_vbar);
      grad_s_out[i] = static_cast<T>(is_real ? grad_s : 0.0);
    }
  }
}

// The keys' gradients from the transposed sums over the later queries i >= j with s_i > t_j
// (sum_a = Σ a_i, sum_sa = Σ s_i a_i, den_above = Σ dden_i, vbar_a_above = Σ a_vbar_i) and, for the
// ties, at_or_above = Σ dden_i over s_i >= t_j:
//   dL/dv_j = sum_sa_j − t_j sum_a_j − Σ_{i≥j} (a_scale_i mass_i / n_i) g_i      (written over sum_sa)
//   dL/dt_j = vbar_a_above_j − v_j·sum_a_j − den_above_j + Σ_{i≥j} dden_i − at_or_above_j
template <typename T>
void backward_keys_rows(const T* g, const T* v, const T* t, const T* real, const T* sum_a, T* sum_sa,
                        const T* a_scale, const T* mass, const T* n_safe, const T* grad_den, const T* den_above,
                        const T* at_or_above, const T* vbar_a_above, T* grad_t_out, int64_t length,
                        int64_t dim, int64_t row_begin, int64_t row_end) {
  std::vector<double> later(dim);
  for (int64_t n = row_begin; n < row_end; ++n) {
    std::fill(later.begin(), later.end(), 0.0);
    double later_den = 0.0;
    for (int64_t i = (n + 1) * length - 1; i >= n * length; --i) {
      const T *gi = g + i * dim, *vi = v + i * dim, *ai = sum_a + i * dim;
      T* wi = sum_sa + i * dim;
      const double coef = static_cast<double>(a_scale[i]) * mass[i] / n_safe[i], ti = t[i];
      const bool is_real = real == nullptr || real[i] != 0;
      const double keep = is_real ? 1.0 : 0.0;
      later_den += grad_den[i];
      double v_a = 0.0;
#pragma omp simd reduction(+ : v_a)
      for (int64_t c = 0; c < dim; ++c) {
        later[c] += coef * gi[c];
        v_a += static_cast<double>(vi[c]) * ai[c];
        wi[c] = static_cast<T>(keep * (wi[c] - ti * ai[c] - later[c]));
      }
      const double grad_t = vbar_a_above[i] - v_a - den_above[i] + later_den - at_or_above[i];
      grad_t_out[i] = static_cast<T>(is_real ? grad_t : 0.0);
    }
  }
}

}  // namespace

// Every array contiguous: (N, length) per token, (N, length, dim) per token and dimension; rows n in
// [row_begin, row_end) of N (over `threads` threads, parallel_rows.h); real may be null.
#define ATTNLAB_CAUSAL_RELU(T, SUFFIX) \
  void causal_relu_forward_##SUFFIX(const T* s, const T* t, const T* v, const T* real, const T* sum_v, \
                                    const T* sum_tv, const T* count, const T* sum_t, double eps, T* out, T* den, \
                                    T* mass, T* n_safe, int64_t length, int64_t dim, int64_t row_begin, \
                                    int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      forward_rows(s, t, v, real, sum_v, sum_tv, count, sum_t, eps, out, den, mass, n_safe, length, dim, begin, end); \
    }); \
  } \
  void causal_relu_backward_queries_##SUFFIX(const T* g, const T* out, const T* v, const T* real, const T* sum_v, \
                                             const T* den, const T* count, const T* count_le, const T* n_safe, \
                                             double eps, T* a_scale, T* grad_den, T* a_vbar, T* grad_s, \
                                             int64_t length, int64_t dim, int64_t row_begin, int64_t row_end, \
                                             int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      backward_queries_rows(g, out, v, real, sum_v, den, count, count_le, n_safe, eps, a_scale, grad_den, a_vbar, \
                            grad_s, length, dim, begin, end); \
    }); \
  } \
  void causal_relu_backward_keys_##SUFFIX(const T* g, const T* v, const T* t, const T* real, const T* sum_a, \
                                          T* sum_sa, const T* a_scale, const T* mass, const T* n_safe, \
                                          const T* grad_den, const T* den_above, const T* at_or_above, \
                                          const T* vbar_a_above, T* grad_t, int64_t length, int64_t dim, \
                                          int64_t row_begin, int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      backward_keys_rows(g, v, t, real, sum_a, sum_sa, a_scale, mass, n_safe, grad_den, den_above, at_or_above, \
                         vbar_a_above, grad_t, length, dim, begin, end); \
    }); \
  }

extern "C" {
ATTNLAB_CAUSAL_RELU(float, f32)
ATTNLAB_CAUSAL_RELU(double, f64)
}
