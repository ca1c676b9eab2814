// The sliced ReLU and ReLU-bump decoding steps (attnlab.attention.sliced_common.decoding), each in one
// call: the token pushed, F evaluated over the sorted runs, the output formed.
//
// Also Π's MLP on a step's few rows (mlp_scores).
//
// F(x) = sum over past keys t_j < x of (x - t_j) [v_j, 1]: the last few tokens summed directly, then in
// each sorted run one binary search and a linear interpolation between the two keys around x (the
// run's total as the slope above its largest key, 0 below its smallest). The torch code does the same in
// about thirty small tensor ops; here it is one pass, summed in double. Plain C++ and no torch headers,
// so that it builds in about a second (attnlab.attention.common.native loads it with ctypes).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// The arrays of one row (batch x head) of a state (the layout: above the extern functions).
template <typename T>
struct Row {
  const T* keys;
  const T* tables;
  const T* totals;
  const T* recent_t;
  const T* recent_rows;
};

// acc[0..width) = F(at) over the runs (sizes run_sizes) and the first `recent` buffered tokens.
template <typename T>
void evaluate(const Row<T>& row, const int64_t* run_sizes, int64_t runs, int64_t recent, int64_t width, double at,
              double* acc) {
  std::fill(acc, acc + width, 0.0);
  for (int64_t j = 0; j < recent; ++j) {  // ReLU(x - t_j) [v_j, 1]
    const double weight = at - row.recent_t[j];
    if (weight > 0) {
      const T* values = row.recent_rows + j * width;
      for (int64_t c = 0; c < width; ++c) acc[c] += weight * values[c];
    }
  }
  int64_t start = 0;
  for (int64_t run = 0; run < runs; ++run) {
    const int64_t size = run_sizes[run];
    const T* first = row.keys + start;
    // keys[pos - 1] < x <= keys[pos], as torch.searchsorted(side="left")
    const int64_t pos = std::lower_bound(first, first + size, static_cast<T>(at)) - first;
    if (pos > 0) {
      const double below = first[pos - 1];
      const T* f_lo = row.tables + (start + pos - 1) * width;
      if (pos == size) {  // above the run: its total is the slope
        const T* total = row.totals + run * width;
        const double step = at - below;
        for (int64_t c = 0; c < width; ++c) acc[c] += f_lo[c] + step * total[c];
      } else {  // F is linear between the two keys around x: a fraction in (0, 1]
        const T* f_hi = f_lo + width;
        const double frac = (at - below) / (static_cast<double>(first[pos]) - below);
        for (int64_t c = 0; c < width; ++c) acc[c] += f_lo[c] + frac * (static_cast<double>(f_hi[c]) - f_lo[c]);
      }
    }
    start += size;
  }
}

template <typename T>
Row<T> row_of(const T* keys, const T* tables, const T* totals, const T* recent_t, const T* recent_rows, int64_t row,
              int64_t width, int64_t key_stride, int64_t total_stride, int64_t recent_stride) {
  return {keys + row * key_stride, tables + row * key_stride * width, totals + row * total_stride * width,
          recent_t + row * recent_stride, recent_rows + row * recent_stride * width};
}

// The running standardisation of one token's scores (standardise_step in scores.py): the pair (s, t)
// shifted by `shift`, added to the sums Σ, Σ² of the `pairs` scores before it, and both standardised by
// the mean and std of all scores so far.
template <typename T>
void standardise(T& s, T& t, T shift, T& total, T& squares, double pairs, double eps) {
  const double ds = static_cast<double>(s) - shift, dt = static_cast<double>(t) - shift;
  total = static_cast<T>(total + (ds + dt));
  squares = static_cast<T>(squares + (ds * ds + dt * dt));
  const double count = pairs + 2, mean = total / count;
  const double std = std::sqrt(std::max(squares / count - mean * mean, 0.0) + eps);
  s = static_cast<T>((ds - mean) / std);
  t = static_cast<T>((dt - mean) / std);
}

// standardise's arguments for every row (shift == nullptr: no standardisation).
template <typename T>
struct Stats {
  const T* shift;
  T* total;
  T* squares;
  double pairs;
  double eps;
};

// The new token (its shifted key score, its value less shift_v) written into the buffer's slot
// `recent`, and the running sums Σ t, Σ v updated (SlicedDecodeState.push).
template <typename T>
void push(T* recent_t, T* recent_rows, int64_t recent, int64_t recent_stride, int64_t r, int64_t dim, T key,
          const T* v, const T* shift_v, T* sum_v, T* sum_t) {
  T* slot_t = recent_t + r * recent_stride + recent;
  T* slot = recent_rows + (r * recent_stride + recent) * (dim + 1);
  *slot_t = key;
  sum_t[r] += key;
  for (int64_t c = 0; c < dim; ++c) {
    slot[c] = v[r * dim + c] - shift_v[r * dim + c];
    sum_v[r * dim + c] += slot[c];
  }
}

// One step of causal sliced ReLU (sliced_relu_attention_step) after the buffer has room: with `stats`,
// the scores standardised first; the token pushed, then o = 2 Σ_j ReLU(s - t_j) (v_j - v̄) /
// max(Σ_j |s - t_j|, eps) over the `count` tokens so far.
template <typename T>
void relu_step(const T* keys, const T* tables, const T* totals, const int64_t* run_sizes, int64_t runs,
               T* recent_t, T* recent_rows, int64_t recent, const T* s, const T* t, const T* v, const T* shift_t,
               const T* shift_v, T* sum_v, T* sum_t, int64_t count, double eps, const Stats<T>& stats, T* out,
               int64_t rows, int64_t dim, int64_t key_stride, int64_t total_stride, int64_t recent_stride) {
  const int64_t width = dim + 1;
  std::vector<double> acc(width);
  for (int64_t r = 0; r < rows; ++r) {
    T query = s[r], key = t[r];
    if (stats.shift != nullptr)
      standardise(query, key, stats.shift[r], stats.total[r], stats.squares[r], stats.pairs, stats.eps);
    push(recent_t, recent_rows, recent, recent_stride, r, dim, static_cast<T>(key - shift_t[r]), v, shift_v, sum_v,
         sum_t);
    const Row<T> row = row_of<T>(keys, tables, totals, recent_t, recent_rows, r, width, key_stride, total_stride,
                                 recent_stride);
    const T at = query - shift_t[r];  // the query's shifted score, rounded as the torch code rounds it
    evaluate(row, run_sizes, runs, recent + 1, width, at, acc.data());
    const double mass = acc[dim], n = static_cast<double>(count);
    // Σ_j |s − t_j| = 2 Σ ReLU(s − t_j) − Σ (s − t_j)
    const double den = std::max(static_cast<double>(sum_t[r]) - n * at + 2.0 * mass, eps);
    for (int64_t c = 0; c < dim; ++c)
      out[r * dim + c] = static_cast<T>(2.0 * (acc[c] - sum_v[r * dim + c] * mass / n) / den);
  }
}

// One step of causal sliced ReLU-bump (sliced_relu_bump_attention_step) after the buffer has room: the
// token pushed, then the hat sums b Σ_j hat(s - t_j) [v_j, 1] = F(s + b) - 2 F(s) + F(s - b), taken in
// double, over b n (`mass` false) or over the hat mass + mass_eps b (`mass` true).
template <typename T>
void bump_step(const T* keys, const T* tables, const T* totals, const int64_t* run_sizes, int64_t runs,
               T* recent_t, T* recent_rows, int64_t recent, const T* s, const T* t, const T* v, const T* shift_t,
               const T* shift_v, T* sum_v, T* sum_t, int64_t count, const T* bandwidth, int64_t heads, bool mass,
               double mass_eps, T* out, int64_t rows, int64_t dim, int64_t key_stride, int64_t total_stride,
               int64_t recent_stride) {
  const int64_t width = dim + 1;
  std::vector<double> below(width), at_s(width), above(width);
  for (int64_t r = 0; r < rows; ++r) {
    push(recent_t, recent_rows, recent, recent_stride, r, dim, static_cast<T>(t[r] - shift_t[r]), v, shift_v, sum_v,
         sum_t);
    const Row<T> row = row_of<T>(keys, tables, totals, recent_t, recent_rows, r, width, key_stride, total_stride,
                                 recent_stride);
    const T query = s[r] - shift_t[r], b = bandwidth[r % heads];
    evaluate(row, run_sizes, runs, recent + 1, width, static_cast<T>(query - b), below.data());
    evaluate(row, run_sizes, runs, recent + 1, width, query, at_s.data());
    evaluate(row, run_sizes, runs, recent + 1, width, static_cast<T>(query + b), above.data());
    const double hat_mass = below[dim] - 2.0 * at_s[dim] + above[dim];
    const double den = mass ? hat_mass + mass_eps * b : static_cast<double>(b) * count;
    for (int64_t c = 0; c < dim; ++c) out[r * dim + c] = static_cast<T>((below[c] - 2.0 * at_s[c] + above[c]) / den);
  }
}

// Π's MLP (Linear, exact GELU, Linear) on the few rows of a decoding step (each sequence's new query
// and key): out (rows, outs) = W2 gelu(W1 x + b1) + b2. torch's matrix product takes about 40 µs for
// two rows through a 512 x 512 map on one core, where reading the map once takes under 30: here W1
// comes transposed (in, hidden) and each of its rows is read once for all the rows, whose hidden sums
// are vectors updated together (summed in T, as a matrix product does).
template <typename T>
void mlp_rows(const T* x, const T* w1t, const T* b1, const T* w2, const T* b2, T* out, int64_t rows, int64_t in,
              int64_t hidden, int64_t outs) {
  std::vector<T> sums(rows * hidden);
  for (int64_t r = 0; r < rows; ++r) std::copy(b1, b1 + hidden, sums.data() + r * hidden);
  for (int64_t i = 0; i < in; ++i) {
    const T* w = w1t + i * hidden;
    for (int64_t r = 0; r < rows; ++r) {
      const T a = x[r * in + i];
      T* target = sums.data() + r * hidden;
#pragma omp simd
      for (int64_t h = 0; h < hidden; ++h) target[h] += a * w[h];
    }
  }
  const T half = static_cast<T>(0.5), root_half = static_cast<T>(M_SQRT1_2);
  for (T& z : sums) z = half * z * (static_cast<T>(1) + std::erf(z * root_half));
  for (int64_t r = 0; r < rows; ++r) {
    const T* hidden_row = sums.data() + r * hidden;
    for (int64_t o = 0; o < outs; ++o) {
      const T* w = w2 + o * hidden;
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t h = 0; h < hidden; ++h) acc += w[h] * hidden_row[h];
      out[r * outs + o] = acc + b2[o];
    }
  }
}

}  // namespace

// The functions below take every array contiguous. keys (rows, key_stride) and tables (rows, key_stride,
// width): the runs one after another (sizes run_sizes); totals (rows, total_stride, width); recent_t
// (rows, recent_stride) and recent_rows (rows, recent_stride, width), the buffer, of which the first
// `recent` slots are in use.
#define ATTNLAB_STATE(T) \
  const T *keys, const T *tables, const T *totals, const int64_t *run_sizes, int64_t runs

extern "C" {

// sliced ReLU's step: s, t (rows), v (rows, dim), shift_t (rows), shift_v (rows, dim); the buffer's slot
// `recent` and the sums sum_v (rows, dim), sum_t (rows) updated; count: tokens including this one;
// out (rows, dim). With stat_shift not null, the scores are standardised first (standardise_step's
// shift, total and squares (rows), updated; pairs: the scores before this token, std_eps its eps).
#define ATTNLAB_RELU_STEP(NAME, T) \
  void NAME(ATTNLAB_STATE(T), T* recent_t, T* recent_rows, int64_t recent, const T* s, const T* t, const T* v, \
            const T* shift_t, const T* shift_v, T* sum_v, T* sum_t, int64_t count, double eps, \
            const T* stat_shift, T* stat_total, T* stat_squares, double pairs, double std_eps, T* out, \
            int64_t rows, int64_t dim, int64_t key_stride, int64_t total_stride, \
            int64_t recent_stride) { \
    const Stats<T> stats{stat_shift, stat_total, stat_squares, pairs, std_eps}; \
    relu_step(keys, tables, totals, run_sizes, runs, recent_t, recent_rows, recent, s, t, v, shift_t, shift_v, \
              sum_v, sum_t, count, eps, stats, out, rows, dim, key_stride, total_stride, \
              recent_stride); \
  }
ATTNLAB_RELU_STEP(sliced_relu_step_f32, float)
ATTNLAB_RELU_STEP(sliced_relu_step_f64, double)

// sliced ReLU-bump's step: as sliced ReLU's, without standardisation; bandwidth (heads), row r's head
// r % heads; mass: the "mass" normaliser (else "count").
#define ATTNLAB_BUMP_STEP(NAME, T) \
  void NAME(ATTNLAB_STATE(T), T* recent_t, T* recent_rows, int64_t recent, const T* s, const T* t, const T* v, \
            const T* shift_t, const T* shift_v, T* sum_v, T* sum_t, int64_t count, const T* bandwidth, \
            int64_t heads, int64_t mass, double mass_eps, T* out, int64_t rows, int64_t dim, int64_t key_stride, \
            int64_t total_stride, int64_t recent_stride) { \
    bump_step(keys, tables, totals, run_sizes, runs, recent_t, recent_rows, recent, s, t, v, shift_t, shift_v, \
              sum_v, sum_t, count, bandwidth, heads, mass != 0, mass_eps, out, rows, dim, key_stride, \
              total_stride, recent_stride); \
  }
ATTNLAB_BUMP_STEP(sliced_relu_bump_step_f32, float)
ATTNLAB_BUMP_STEP(sliced_relu_bump_step_f64, double)

// Π's MLP (mlp_rows): x (rows, in), w1t (in, hidden), b1 (hidden), w2 (outs, hidden), b2 (outs), out (rows, outs).
#define ATTNLAB_MLP_SCORES(NAME, T) \
  void NAME(const T* x, const T* w1t, const T* b1, const T* w2, const T* b2, T* out, int64_t rows, int64_t in, \
            int64_t hidden, int64_t outs) { \
    mlp_rows(x, w1t, b1, w2, b2, out, rows, in, hidden, outs); \
  }
ATTNLAB_MLP_SCORES(mlp_scores_f32, float)
ATTNLAB_MLP_SCORES(mlp_scores_f64, double)

}  // extern "C"
