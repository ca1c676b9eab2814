// Bidirectional sliced ReLU-bump on the CPU: the D-wide part of the sorted op (sliced_relu_bump/sorted.py)
// as walks over each row's sorted scores, summing in double, with no prefix tables in memory.
//
// Every sum the op needs is a hat window sum: for a centre c of width b, over the sources (rows u_k at
// scores x_k) in the left window (c − b, c] and the right window (c, c + b),
//   b Σ_k hat(c − x_k) u_k = (b − c) L + L_x + (b + c) R − R_x      (L, R: Σ u; L_x, R_x: Σ x u)
// and the derivative's windows split at c (keys tied with c drop out). The torch code builds (T + 1) x D
// prefix tables of u and x u and gathers them at each centre's window bounds. Here the centres are
// visited in ascending order, so every bound (c − b, c, c + b) only moves up: three walkers (at the
// bounds x <= c − b, x <= c, x < c + b) go up the sorted sources once each, keeping their running sums
// in double, and each centre reads its windows as differences of the walkers' sums. The derivatives'
// left window without the sources tied with c (x < c) is the one to x <= c less the tied run, summed
// apart where there is one (rarely: a fourth walker at x < c cost a seventh of the walks). Forward (sources:
// the keys, centres: the queries), the queries' gradients (the same walk, dotted with g_i) and the
// keys' gradients (sources: the queries' c_i g_i, centres: the keys; the hat is symmetric). Plain C++
// without torch's headers (attnlab.attention.common.native builds it).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/parallel_rows.h"

namespace {

constexpr int64_t AHEAD = 16;  // sources ahead of a walker whose rows are prefetched (sorted order: random rows)

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  for (int64_t c = 0; c < dim; c += 64 / sizeof(T)) __builtin_prefetch(row + c, 0);
}

template <typename T>
inline void prefetch_row_for_write(T* row, int64_t dim) {
  for (int64_t c = 0; c < dim; c += 64 / sizeof(T)) __builtin_prefetch(row + c, 1);
}

// The sources of one row: row k is weight_k u_k at score x_k; `order` lists them by ascending
// score (x_sorted), the first `count` of them real (the walks stop there).
template <typename T>
struct Sources {
  const T* u;
  const int64_t* order;
  const T* x_sorted;
  const T* weight;  // by index, null: one
  int64_t count, dim;
};

// Running sums over the sources below a moving bound: Σ row, Σ x row (when `scored`), Σ x, the count.
template <typename T>
struct Walker {
  std::vector<double> rows, scored_rows;
  double sum_x = 0.0;
  int64_t at = 0;

  Walker(int64_t dim, bool scored) : rows(dim, 0.0), scored_rows(scored ? dim : 0, 0.0) {}

  template <typename Below>
  void advance(const Sources<T>& src, Below below) {
    const int64_t dim = src.dim;
    while (at < src.count && below(src.x_sorted[at])) {
      if (at + AHEAD < src.count) prefetch_row(src.u + src.order[at + AHEAD] * dim, dim);
      const int64_t k = src.order[at];
      const T* row = src.u + k * dim;
      const double w = src.weight == nullptr ? 1.0 : static_cast<double>(src.weight[k]);
      const double x = src.x_sorted[at], wx = w * x;
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) rows[c] += w * row[c];
      if (!scored_rows.empty()) {
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) scored_rows[c] += wx * row[c];
      }
      sum_x += x;
      ++at;
    }
  }
};

// The three walkers at one centre: lo (x <= c − b), mid (x <= c), hi (x < c + b).
template <typename T>
struct Windows {
  Walker<T> lo, mid, hi;
  std::vector<double> tied_rows;
  explicit Windows(int64_t dim) : lo(dim, true), mid(dim, true), hi(dim, true), tied_rows(dim) {}

  // Moves to the centre c (centres visited in ascending order); the bounds in T's arithmetic, as the
  // torch code computes them.
  void move_to(const Sources<T>& src, T c, T width) {
    const T low = c - width, high = c + width;
    lo.advance(src, [low](T x) { return x <= low; });
    mid.advance(src, [c](T x) { return x <= c; });
    hi.advance(src, [high](T x) { return x < high; });
  }

  // The sources tied with the centre c (x == c, the last ones mid passed): their count, and their rows'
  // sum in tied_rows when there are any (the walkers' w u).
  int64_t tied(const Sources<T>& src, T c) {
    int64_t first = mid.at;
    while (first > 0 && src.x_sorted[first - 1] == c) --first;
    if (first == mid.at) return 0;
    const int64_t dim = src.dim;
    std::fill(tied_rows.begin(), tied_rows.end(), 0.0);
    for (int64_t p = first; p < mid.at; ++p) {
      const int64_t k = src.order[p];
      const T* row = src.u + k * dim;
      const double w = src.weight == nullptr ? 1.0 : static_cast<double>(src.weight[k]);
      for (int64_t d = 0; d < dim; ++d) tied_rows[d] += w * row[d];
    }
    return mid.at - first;
  }
};

// The walkers' running sums as local pointers, for the loops over the dimension: read through the
// vectors (or a struct's pointers) inside an `omp simd` reduction, GCC 12 gathers every element by
// its own address.
#define WINDOW_ROWS(w)                                                                                 \
  const double *lo = (w).lo.rows.data(), *mid = (w).mid.rows.data(), *hi = (w).hi.rows.data(),       \
               *lo_x = (w).lo.scored_rows.data(), *mid_x = (w).mid.scored_rows.data(),               \
               *hi_x = (w).hi.scored_rows.data()

// Visits every centre of `centre_order` (ascending, `n_centres` of them) with its windows, after
// prefetch(i) of the centre AHEAD of it (the rows its visit reads or writes: in sorted order, random).
template <typename T, typename Visit, typename Prefetch>
void walk_windows(const Sources<T>& src, const T* centre, const int64_t* centre_order, int64_t n_centres, T width,
                  Visit visit, Prefetch prefetch) {
  Windows<T> windows(src.dim);
  for (int64_t q = 0; q < n_centres; ++q) {
    if (q + AHEAD < n_centres) prefetch(centre_order[q + AHEAD]);
    const int64_t i = centre_order[q];
    windows.move_to(src, centre[i], width);
    visit(i, windows);
  }
}

// Forward: out_i = coef_i b Σ_j hat(s_i − t_j) v_j. The walkers sum the values as they are, in double:
// a common offset of the values costs no precision the outputs can show (centring them, as the torch
// code's float32 tables must, cost every walker a subtraction per element).
template <typename T>
void forward_rows(const T* v, const int64_t* order, const T* t_sorted, const int64_t* count, const T* s,
                  const int64_t* s_order, const T* width, const T* coef, T* out, int64_t length, int64_t dim,
                  int64_t row_begin, int64_t row_end) {
  for (int64_t n = row_begin; n < row_end; ++n) {
    const int64_t at = n * length;
    const Sources<T> keys{v + at * dim, order + at, t_sorted + at, nullptr, count[n], dim};
    const double b = width[n];
    walk_windows(keys, s + at, s_order + at, length, width[n], [&](int64_t i, Windows<T>& w) {
      const double c = s[at + i], a = coef[at + i];
      const double left_coef = a * (b - c), right_coef = a * (b + c);
      T* target = out + (at + i) * dim;
      WINDOW_ROWS(w);
#pragma omp simd
      for (int64_t k = 0; k < dim; ++k) {
        const double left = mid[k] - lo[k], right = hi[k] - mid[k];
        const double left_x = mid_x[k] - lo_x[k], right_x = hi_x[k] - mid_x[k];
        target[k] = static_cast<T>(left_coef * left + a * left_x + right_coef * right - a * right_x);
      }
    }, [&](int64_t i) { prefetch_row_for_write(out + (at + i) * dim, dim); });
  }
}

// The queries' gradients, with g_i = dL/do_i:
//   dL/ds_i = coef_i g_i · (Σ_{t∈(s,s+b)} v − Σ_{t∈(s−b,s)} v)         (keys tied with s_i drop out)
//   dL/db  += coef_i / b · g_i · (s_i (L − R) + R_x − L_x)               (per query, summed by the caller)
template <typename T>
void query_grads_rows(const T* v, const int64_t* order, const T* t_sorted, const int64_t* count, const T* s,
                      const int64_t* s_order, const T* width, const T* coef, const T* g, T* grad_s, T* grad_b,
                      int64_t length, int64_t dim, int64_t row_begin, int64_t row_end) {
  for (int64_t n = row_begin; n < row_end; ++n) {
    const int64_t at = n * length;
    const Sources<T> keys{v + at * dim, order + at, t_sorted + at, nullptr, count[n], dim};
    const double b = width[n];
    walk_windows(keys, s + at, s_order + at, length, width[n], [&](int64_t i, Windows<T>& w) {
      const T* gi = g + (at + i) * dim;
      WINDOW_ROWS(w);
      double left = 0.0, right = 0.0, left_x = 0.0, right_x = 0.0;
#pragma omp simd reduction(+ : left, right, left_x, right_x)
      for (int64_t k = 0; k < dim; ++k) {
        const double gk = gi[k];
        left += gk * (mid[k] - lo[k]);
        right += gk * (hi[k] - mid[k]);
        left_x += gk * (mid_x[k] - lo_x[k]);
        right_x += gk * (hi_x[k] - mid_x[k]);
      }
      double tied_left = left;  // the left window without the tied keys
      if (w.tied(keys, s[at + i]) > 0) {
        for (int64_t k = 0; k < dim; ++k) tied_left -= static_cast<double>(gi[k]) * w.tied_rows[k];
      }
      const double c = s[at + i], a = coef[at + i];
      grad_s[at + i] = static_cast<T>(a * (right - tied_left));
      grad_b[at + i] = static_cast<T>(a / b * (c * (left - right) + right_x - left_x));
    }, [&](int64_t i) { prefetch_row(g + (at + i) * dim, dim); });
  }
}

// The keys' gradients (sources: the queries' rows coef_i g_i at s_i, in s_order; centres: the real keys
// in key order, the first count[n] of it; padded keys get zeros). The output is coef_i b Σ_j hat w_j:
//   dL/dv_j = b Σ_i coef_i hat(s_i − t_j) g_i
//   dL/dt_j = v_j · (Σ_{s∈(t,t+b)} coef g − Σ_{s∈(t−b,t)} coef g)
template <typename T>
void key_grads_rows(const T* g, const int64_t* s_order, const T* s_sorted, const T* coef, const T* v,
                    const int64_t* order, const int64_t* count, const T* t, const T* width, T* grad_v, T* grad_t,
                    int64_t length, int64_t dim, int64_t row_begin, int64_t row_end) {
  for (int64_t n = row_begin; n < row_end; ++n) {
    const int64_t at = n * length;
    const Sources<T> queries{g + at * dim, s_order + at, s_sorted + at, coef + at, length, dim};
    const double b = width[n];
    walk_windows(queries, t + at, order + at, count[n], width[n], [&](int64_t j, Windows<T>& w) {
      const double c = t[at + j];
      const T* vj = v + (at + j) * dim;
      T* target = grad_v + (at + j) * dim;
      WINDOW_ROWS(w);
      double dot = 0.0;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < dim; ++k) {
        const double left = mid[k] - lo[k], right = hi[k] - mid[k];
        const double left_x = mid_x[k] - lo_x[k], right_x = hi_x[k] - mid_x[k];
        target[k] = static_cast<T>((b - c) * left + left_x + (b + c) * right - right_x);
        dot += vj[k] * (right - left);
      }
      // the left window without the queries tied with t_j: dot with right − (left − tied)
      if (w.tied(queries, t[at + j]) > 0) {
        for (int64_t k = 0; k < dim; ++k) dot += static_cast<double>(vj[k]) * w.tied_rows[k];
      }
      grad_t[at + j] = static_cast<T>(dot);
    }, [&](int64_t j) {
      prefetch_row(v + (at + j) * dim, dim);
      prefetch_row_for_write(grad_v + (at + j) * dim, dim);
    });
    for (int64_t p = count[n]; p < length; ++p) {  // padded keys: no gradient
      const int64_t j = order[at + p];
      std::fill(grad_v + (at + j) * dim, grad_v + (at + j + 1) * dim, static_cast<T>(0));
      grad_t[at + j] = 0;
    }
  }
}

#undef WINDOW_ROWS

}  // namespace

// Every array contiguous, rows n in [row_begin, row_end) of N (over `threads` threads, parallel_rows.h): v, g, out, grad_v (N, length, dim); order
// (keys by ascending score, the count[n] real ones first) and t_sorted, s_order (every query by ascending
// score) and s_sorted, s, t, coef, grad_s, grad_b (N, length); count (N) real keys; width (N) the
// bandwidth.
#define ATTNLAB_FORWARD(NAME, T) \
  void NAME(const T* v, const int64_t* order, const T* t_sorted, const int64_t* count, const T* s, \
            const int64_t* s_order, const T* width, const T* coef, T* out, int64_t length, int64_t dim, \
            int64_t row_begin, int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      forward_rows(v, order, t_sorted, count, s, s_order, width, coef, out, length, dim, begin, end); \
    }); \
  }
#define ATTNLAB_QUERY_GRADS(NAME, T) \
  void NAME(const T* v, const int64_t* order, const T* t_sorted, const int64_t* count, const T* s, \
            const int64_t* s_order, const T* width, const T* coef, const T* g, T* grad_s, T* grad_b, int64_t length, \
            int64_t dim, int64_t row_begin, int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      query_grads_rows(v, order, t_sorted, count, s, s_order, width, coef, g, grad_s, grad_b, length, dim, begin, \
                       end); \
    }); \
  }
#define ATTNLAB_KEY_GRADS(NAME, T) \
  void NAME(const T* g, const int64_t* s_order, const T* s_sorted, const T* coef, const T* v, const int64_t* order, \
            const int64_t* count, const T* t, const T* width, T* grad_v, T* grad_t, int64_t length, int64_t dim, \
            int64_t row_begin, int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      key_grads_rows(g, s_order, s_sorted, coef, v, order, count, t, width, grad_v, grad_t, length, dim, begin, end); \
    }); \
  }

extern "C" {
ATTNLAB_FORWARD(sliced_relu_bump_forward_f32, float)
ATTNLAB_FORWARD(sliced_relu_bump_forward_f64, double)
ATTNLAB_QUERY_GRADS(sliced_relu_bump_query_grads_f32, float)
ATTNLAB_QUERY_GRADS(sliced_relu_bump_query_grads_f64, double)
ATTNLAB_KEY_GRADS(sliced_relu_bump_key_grads_f32, float)
ATTNLAB_KEY_GRADS(sliced_relu_bump_key_grads_f64, double)
}
