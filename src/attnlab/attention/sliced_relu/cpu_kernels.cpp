// Bidirectional sliced ReLU on the CPU: the D-wide part of the sorted op (sliced_relu/sorted.py) as two
// walks over each row's keys in sorted order, one pass over v (and g) each way.
//
// The torch code builds (T + 1) x D prefix tables of w = v - vbar and of t w in memory, then gathers
// them at each query's rank: eight or so full passes over (N, T, D) memory. Here each row's queries are
// bucketed by rank (rank_i = #{keys t_j < s_i}, a counting sort: no comparison), and one walk up the
// sorted keys keeps the running sums A = Σ w, B = Σ t w (in double) and writes each query's output
// when the walk reaches its rank. The backward walks up for the queries' side (g_i · A at rank_i, and
// Σ_j dL/dw_j, analytically) and down for the keys' side (the sums over queries above each key), so
// it needs no sort of the queries. The sorts, ranks, denominators and masks stay in torch. Plain C++ without torch's
// headers: attnlab.attention.common.native builds it in about a second and calls it with ctypes, one
// call per group of rows on each of torch's threads.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/parallel_rows.h"

namespace {

// mean (dim), in double: the mean of v's rows (length, dim) over the row's real keys, the first
// `count` of `order`: summed in time order, one sequential pass (in sorted order every row is a random
// read), and the same sum whatever padding sits among the real keys.
template <typename T>
void real_mean(const T* v, const int64_t* order, int64_t count, int64_t length, int64_t dim, double* mean) {
  std::vector<char> real(length, count == length ? 1 : 0);
  if (count < length) {
    for (int64_t p = 0; p < count; ++p) real[order[p]] = 1;
  }
  std::fill(mean, mean + dim, 0.0);
  for (int64_t j = 0; j < length; ++j) {
    if (!real[j]) continue;
    const T* row = v + j * dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) mean[c] += row[c];
  }
  for (int64_t c = 0; c < dim; ++c) mean[c] = count > 0 ? mean[c] / count : 0.0;
}

// Queries of one row grouped by rank: the queries of rank r are query[first[r] .. first[r + 1]).
struct Buckets {
  std::vector<int64_t> first, query;

  Buckets(const int64_t* rank, int64_t length, int64_t count) : first(count + 2, 0), query(length) {
    for (int64_t i = 0; i < length; ++i) ++first[rank[i] + 1];
    for (int64_t r = 0; r <= count; ++r) first[r + 1] += first[r];
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < length; ++i) query[next[rank[i]]++] = i;
  }
};

// Rows ahead of the walk to prefetch: the walks read rows in sorted order, which the hardware cannot guess.
constexpr int64_t AHEAD = 48;

template <typename T>
inline void prefetch_row(const T* row, int64_t dim, bool write) {
  for (int64_t c = 0; c < dim; c += 64 / sizeof(T)) {
    if (write)
      __builtin_prefetch(row + c, 1);
    else
      __builtin_prefetch(row + c, 0);
  }
}

// out_i = scale_i (s_i Σ_{t_j<s_i} w_j − Σ_{t_j<s_i} t_j w_j) for every query; vbar written too.
template <typename T>
void forward_rows(const T* v, const int64_t* order, const T* t_sorted, const T* s, const int64_t* rank,
                  const int64_t* count, const T* scale, double* vbar, T* out, int64_t length, int64_t dim,
                  int64_t row_begin, int64_t row_end) {
  std::vector<double> mean(dim), sum_w(dim), sum_tw(dim);
  for (int64_t n = row_begin; n < row_end; ++n) {
    const T* rv = v + n * length * dim;
    const int64_t* ro = order + n * length;
    const int64_t* rr = rank + n * length;
    const T* rt = t_sorted + n * length;
    const T* rs = s + n * length;
    const T* rscale = scale + n * length;
    T* rout = out + n * length * dim;
    real_mean(rv, ro, count[n], length, dim, mean.data());  // vbar
    std::copy(mean.begin(), mean.end(), vbar + n * dim);  // in double: the backward's w is the forward's
    const Buckets buckets(rr, length, count[n]);
    std::fill(sum_w.begin(), sum_w.end(), 0.0);
    std::fill(sum_tw.begin(), sum_tw.end(), 0.0);
    for (int64_t r = 0; r <= count[n]; ++r) {
      if (r + AHEAD < count[n]) prefetch_row(rv + ro[r + AHEAD] * dim, dim, false);
      for (int64_t k = buckets.first[r]; k < buckets.first[r + 1]; ++k) {
        const int64_t i = buckets.query[k];
        if (k + AHEAD < length) prefetch_row(rout + buckets.query[k + AHEAD] * dim, dim, true);
        const double a = rscale[i], sa = static_cast<double>(rs[i]) * a;
        T* target = rout + i * dim;
        for (int64_t c = 0; c < dim; ++c) target[c] = static_cast<T>(sa * sum_w[c] - a * sum_tw[c]);
      }
      if (r == count[n]) break;
      const T* key = rv + ro[r] * dim;
      const double t = rt[r];
      #pragma omp simd
      for (int64_t c = 0; c < dim; ++c) {
        const double w = key[c] - mean[c];
        sum_w[c] += w;
        sum_tw[c] += t * w;
      }
    }
  }
}

// The backward's sums, with a_i = dL/dN_i and e_i = dL/dden_i (both zero at dropped queries):
//   below_i = g_i · Σ_{t_j<s_i} w_j                              (dL/ds_i = a_i below_i + ...)
//   grad_v_j = Σ_{s_i>t_j} a_i (s_i − t_j) g_i − mean_k(same)    (real keys; 0 at padded ones)
//   grad_t_j = Σ_{s_i<t_j} e_i − Σ_{s_i>t_j} e_i − w_j · Σ_{s_i>t_j} a_i g_i
// s_i > t_j exactly when rank_i > p, the key's sorted position, and s_i >= t_j when rank_le_i > p
// (rank_le_i = #{t_j <= s_i}). A first pass over the queries in their own order (sequential memory)
// takes the totals Σ a_i g_i, Σ a_i s_i g_i, Σ e_i and the mean over keys, Σ_i a_i R_i g_i / count
// with R_i = Σ_{t_j<s_i} (s_i − t_j); then one walk up the keys takes each query out of the totals at
// its rank, so that they hold a key's sums over the queries above it (in double; the mean over keys
// is taken out of Σ a_i s_i g_i once: a key reads two running sums, not six arrays).
template <typename T>
void backward_rows(const T* v, const int64_t* order, const T* t_sorted, const T* s, const int64_t* rank,
                   const int64_t* rank_le, const int64_t* count, const double* vbar, const T* g, const T* a,
                   const T* out, const T* e_scale, T* e, T* below, T* grad_v, T* grad_t, int64_t length,
                   int64_t dim, int64_t row_begin, int64_t row_end) {
  std::vector<double> sum_w(dim), mean_grad(dim), above_a(dim), above_sa(dim);
  std::vector<double> prefix_t(length + 1);
  for (int64_t n = row_begin; n < row_end; ++n) {
    const T* rv = v + n * length * dim;
    const T* rg = g + n * length * dim;
    const int64_t* ro = order + n * length;
    const int64_t* rr = rank + n * length;
    const T* rt = t_sorted + n * length;
    const T* rs = s + n * length;
    const T* ra = a + n * length;
    const T* rout = out + n * length * dim;
    const T* res = e_scale + n * length;
    T* re = e + n * length;
    const double* mean = vbar + n * dim;
    T* rgv = grad_v + n * length * dim;
    T* rgt = grad_t + n * length;
    const int64_t real = count[n];

    prefix_t[0] = 0.0;
    for (int64_t p = 0; p < real; ++p) prefix_t[p + 1] = prefix_t[p] + rt[p];
    std::fill(mean_grad.begin(), mean_grad.end(), 0.0);
    std::fill(above_a.begin(), above_a.end(), 0.0);
    std::fill(above_sa.begin(), above_sa.end(), 0.0);
    double total_e = 0.0;
    for (int64_t i = 0; i < length; ++i) {  // the queries in their own order: the totals, and e_i
      const T *gi = rg + i * dim, *oi = rout + i * dim;
      const double ai = ra[i], sai = ai * static_cast<double>(rs[i]);
      const double weight = ai * (static_cast<double>(rs[i]) * rr[i] - prefix_t[rr[i]]);  // a_i R_i
      double g_out = 0.0;
      #pragma omp simd reduction(+ : g_out)
      for (int64_t c = 0; c < dim; ++c) {
        above_a[c] += ai * gi[c];
        above_sa[c] += sai * gi[c];
        mean_grad[c] += weight * gi[c];
        g_out += static_cast<double>(gi[c]) * oi[c];
      }
      re[i] = res[i] == 0 ? static_cast<T>(0) : static_cast<T>(-g_out * res[i]);  // dL/dden_i
      total_e += re[i];
    }
    for (int64_t c = 0; c < dim; ++c) above_sa[c] -= real > 0 ? mean_grad[c] / real : 0.0;

    const Buckets by_rank(rr, length, real), by_rank_le(rank_le + n * length, length, real);
    std::fill(sum_w.begin(), sum_w.end(), 0.0);
    double seen_e = 0.0, seen_e_le = 0.0;
    for (int64_t r = 0; r <= real; ++r) {
      if (r + AHEAD < real) {
        prefetch_row(rv + ro[r + AHEAD] * dim, dim, false);
        prefetch_row(rgv + ro[r + AHEAD] * dim, dim, true);
      }
      for (int64_t k = by_rank.first[r]; k < by_rank.first[r + 1]; ++k) {  // queries of rank r
        const int64_t i = by_rank.query[k];
        if (k + AHEAD < length) prefetch_row(rg + by_rank.query[k + AHEAD] * dim, dim, false);
        const T* gi = rg + i * dim;
        const double ai = ra[i], sai = ai * static_cast<double>(rs[i]);
        double dot = 0.0;
        #pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < dim; ++c) {
          dot += gi[c] * sum_w[c];
          above_a[c] -= ai * gi[c];
          above_sa[c] -= sai * gi[c];
        }
        below[n * length + i] = static_cast<T>(dot);
        seen_e += re[i];
      }
      for (int64_t k = by_rank_le.first[r]; k < by_rank_le.first[r + 1]; ++k) seen_e_le += re[by_rank_le.query[k]];
      if (r == real) break;
      const int64_t j = ro[r];  // the key at sorted position r: the queries above it are the rest
      const T* key = rv + j * dim;
      T* target = rgv + j * dim;
      const double t = rt[r];
      double dot = 0.0;
      #pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < dim; ++c) {
        const double w = key[c] - static_cast<double>(mean[c]);
        target[c] = static_cast<T>(above_sa[c] - t * above_a[c]);
        dot += w * above_a[c];
        sum_w[c] += w;
      }
      // Σ_{s_i<t_j} e_i = total − Σ_{rank_le_i > r} e_i = (the rank_le buckets up to r)
      rgt[j] = static_cast<T>(seen_e_le - (total_e - seen_e) - dot);
    }
    for (int64_t p = real; p < length; ++p) {  // padded keys: no gradient
      const int64_t j = ro[p];
      std::fill(rgv + j * dim, rgv + (j + 1) * dim, static_cast<T>(0));
      rgt[j] = 0;
    }
  }
}

// rank_i = #{t < s_i} and rank_le_i = #{t <= s_i} in each row's ascending keys t_search (torch's
// searchsorted, left and right, in one pass: its CPU kernel took 7 ms a call at (8, 16K)). The searches
// are branchless and run GROUP queries in step (the halving depends on the length alone), so that their
// loads overlap instead of each waiting on a mispredicted branch (32 in step: 3x faster than 8 at 16K).
template <typename T>
void ranks_rows(const T* t_search, const T* s, int64_t* rank, int64_t* rank_le, int64_t length, int64_t row_begin,
                int64_t row_end) {
  constexpr int64_t GROUP = 32;
  if (length == 0) return;
  for (int64_t n = row_begin; n < row_end; ++n) {
    const T* keys = t_search + n * length;
    for (int64_t first = n * length; first < (n + 1) * length; first += GROUP) {
      const int64_t size = std::min(GROUP, (n + 1) * length - first);
      int64_t at[GROUP] = {};
      for (int64_t left = length; left > 1;) {  // the answer lies in [at, at + left]
        const int64_t half = left / 2;
        for (int64_t g = 0; g < size; ++g) at[g] = keys[at[g] + half - 1] < s[first + g] ? at[g] + half : at[g];
        left -= half;
      }
      for (int64_t g = 0; g < size; ++g) {
        const int64_t i = first + g;
        rank[i] = at[g] + (keys[at[g]] < s[i]);
        const bool tied = rank[i] < length && keys[rank[i]] == s[i];
        rank_le[i] = tied ? std::upper_bound(keys + rank[i], keys + length, s[i]) - keys : rank[i];
      }
    }
  }
}

}  // namespace

// Every array contiguous, rows n in [row_begin, row_end) of N (over `threads` threads, parallel_rows.h): v, out, g, grad_v (N, length, dim);
// order (keys by ascending score, the `count` real ones first), t_sorted, s, rank, rank_le, scale, a,
// e_scale, e, below, grad_t (N, length); count (N) real keys; vbar (N, dim) in double (the mean the
// forward centred by, rounded to T it would give the backward other w's: a large common value offset
// made dL/ds 2 % off in float32).
#define ATTNLAB_FORWARD(NAME, T) \
  void NAME(const T* v, const int64_t* order, const T* t_sorted, const T* s, const int64_t* rank, \
            const int64_t* count, const T* scale, double* vbar, T* out, int64_t length, int64_t dim, int64_t row_begin, \
            int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      forward_rows(v, order, t_sorted, s, rank, count, scale, vbar, out, length, dim, begin, end); \
    }); \
  }
#define ATTNLAB_BACKWARD(NAME, T) \
  void NAME(const T* v, const int64_t* order, const T* t_sorted, const T* s, const int64_t* rank, \
            const int64_t* rank_le, const int64_t* count, const double* vbar, const T* g, const T* a, const T* out, \
            const T* e_scale, T* e, T* below, T* grad_v, T* grad_t, int64_t length, int64_t dim, int64_t row_begin, \
            int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      backward_rows(v, order, t_sorted, s, rank, rank_le, count, vbar, g, a, out, e_scale, e, below, grad_v, grad_t, \
                    length, dim, begin, end); \
    }); \
  }

#define ATTNLAB_RANKS(NAME, T) \
  void NAME(const T* t_search, const T* s, int64_t* rank, int64_t* rank_le, int64_t length, int64_t dim, \
            int64_t row_begin, int64_t row_end, int64_t threads) { \
    (void)dim; \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      ranks_rows(t_search, s, rank, rank_le, length, begin, end); \
    }); \
  }

extern "C" {
ATTNLAB_RANKS(sliced_relu_ranks_f32, float)
ATTNLAB_RANKS(sliced_relu_ranks_f64, double)
ATTNLAB_FORWARD(sliced_relu_forward_f32, float)
ATTNLAB_FORWARD(sliced_relu_forward_f64, double)
ATTNLAB_BACKWARD(sliced_relu_backward_f32, float)
ATTNLAB_BACKWARD(sliced_relu_backward_f64, double)
}
