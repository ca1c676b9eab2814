// Causal linear attention's decoding step on the CPU (attnlab.attention.linear.decoding), in one call:
// for every row (batch x head), with phi(x) = elu(x) + 1,
//   S += phi(k) v^T,  z += phi(k),  out = phi(q)^T S / (phi(q) . z + eps)
// S and z updated in place. The torch code is a dozen small tensor ops, each a few microseconds of
// dispatch around a few kilobytes of arithmetic; here the step is one pass over the state. The state
// is summed in its own dtype (as the torch code adds to it), the output's dot products in double.
// Plain C++ without torch's headers (attnlab.attention.common.native builds it).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline double feature(T x) {
  return x > 0 ? static_cast<double>(x) + 1.0 : std::exp(static_cast<double>(x));
}

template <typename T>
void step_rows(const T* q, const T* k, const T* v, T* state, T* norm, double eps, T* out, int64_t rows, int64_t dim,
               int64_t value_dim) {
  std::vector<double> phi_q(dim), acc(value_dim);
  std::vector<T> phi_k(dim);
  for (int64_t r = 0; r < rows; ++r) {
    const T *qr = q + r * dim, *kr = k + r * dim, *vr = v + r * value_dim;
    T* s = state + r * dim * value_dim;
    T* z = norm + r * dim;
    double den = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      phi_q[d] = feature(qr[d]);
      phi_k[d] = static_cast<T>(feature(kr[d]));
      z[d] += phi_k[d];
      den += phi_q[d] * z[d];
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    double* sums = acc.data();
    for (int64_t d = 0; d < dim; ++d) {
      const T phi = phi_k[d];
      const double weight = phi_q[d];
      T* s_row = s + d * value_dim;
#pragma omp simd
      for (int64_t e = 0; e < value_dim; ++e) {
        s_row[e] += phi * vr[e];
        sums[e] += weight * s_row[e];
      }
    }
    den += eps;
    T* target = out + r * value_dim;
    for (int64_t e = 0; e < value_dim; ++e) target[e] = static_cast<T>(sums[e] / den);
  }
}

}  // namespace

// q, k (rows, dim), v (rows, value_dim), state (rows, dim, value_dim) and norm (rows, dim) updated,
// out (rows, value_dim); every array contiguous.
#define ATTNLAB_LINEAR_STEP(NAME, T) \
  void NAME(const T* q, const T* k, const T* v, T* state, T* norm, double eps, T* out, int64_t rows, int64_t dim, \
            int64_t value_dim) { \
    step_rows(q, k, v, state, norm, eps, out, rows, dim, value_dim); \
  }

extern "C" {
ATTNLAB_LINEAR_STEP(linear_step_f32, float)
ATTNLAB_LINEAR_STEP(linear_step_f64, double)
}
