// Causal dominance sums on the CPU (sliced_common/dominance.py, merged.py): for thresholds x_i and a
// table of weight rows, S_i = Σ_{j ≤ i, key_j < x_i} table_j (or key_j <= x_i) for every position i,
// and the transpose Σ_{i ≥ j, key_j < x_i} table_i for every j.
//
// The torch code splits time into log2(T / chunk) levels of blocks, sorts and searches each level
// and gathers its prefix tables: about two full passes over (T, W) memory per level. Here time is
// cut into blocks of `chunk` tokens once. Pairs inside a block are summed directly (a triangle of
// chunk²/2 row additions, in time order). Pairs across blocks come from one walk per row over the
// keys and the thresholds in ascending score order (two sorted index lists, merged): a key adds its
// row to a Fenwick tree indexed by its block, and a threshold reads the sum of the blocks before its
// own: log2(T / chunk) rows of doubles each, in a tree of (T / chunk) rows that stays in the cache
// (1 MiB at T = 16K, W = 130, chunk 16). The transpose walks down the scores with the roles exchanged.
// The walk keeps its sums in the order it finds them (rounded to the table's dtype, in a buffer of
// T x W per thread: 34 MB at T = 64K, W = 130 in float32); the pass over the blocks, in time order,
// adds them to the block's own and writes each output row once. Sums in double, each output rounded
// twice (the walk's part, then the whole). Plain C++ without torch's headers
// (attnlab.attention.common.native builds it).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "../common/parallel_rows.h"

namespace {

constexpr int64_t AHEAD = 16;  // walk events ahead whose rows are prefetched (sorted order: random rows)

template <typename T>
inline void prefetch_row(const T* row, int64_t width, int write) {
  for (int64_t c = 0; c < width; c += 64 / sizeof(T)) {
    if (write)
      __builtin_prefetch(row + c, 1);
    else
      __builtin_prefetch(row + c, 0);
  }
}

// The rows being summed, as a materialised table (length, width).
template <typename T>
struct TableRows {
  const T* table;
  int64_t width;

  void add(int64_t q, double* acc) const {
    const T* row = table + q * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) acc[c] += row[c];
  }
  void prefetch(int64_t q) const { prefetch_row(table + q * width, width, 0); }
};

// Rows [scale_q u_q, scale_q score_q u_q, first_q, second_q] (width 2 dim + 2) built from their parts
// as they are read (causal sliced ReLU's tables: values and score times values): half the memory of
// the table. scale null: one.
template <typename T>
struct PairRows {
  const T *u, *scale, *score, *first, *second;
  int64_t dim, width;

  void add(int64_t q, double* acc) const {
    const T* row = u + q * dim;
    const double a = scale == nullptr ? 1.0 : static_cast<double>(scale[q]);
    const double b = a * static_cast<double>(score[q]);
    double* acc_score = acc + dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) {
      acc[c] += a * row[c];
      acc_score[c] += b * row[c];
    }
    acc[2 * dim] += first[q];
    acc[2 * dim + 1] += second[q];
  }
  void prefetch(int64_t q) const { prefetch_row(u + q * dim, dim, 0); }

};

// A Fenwick tree over time blocks; each node is a row of `width` doubles.
class BlockTree {
  static constexpr int64_t CHUNK = 16;  // columns summed in registers at once (four AVX2 vectors)

 public:
  BlockTree(int64_t blocks, int64_t width) : blocks_(blocks), width_(width), node_((blocks + 1) * width, 0.0) {}

  void add(int64_t block, const double* row) {
    for (int64_t p = block + 1; p <= blocks_; p += p & -p) {
      double* target = node_.data() + p * width_;
#pragma omp simd
      for (int64_t c = 0; c < width_; ++c) target[c] += row[c];
    }
  }

  // acc = the sum of the rows added to blocks 0 .. block - 1. Column chunks outside, nodes inside: each
  // chunk's sums stay in registers and acc is written once, not once per node.
  void before(int64_t block, double* acc) const {
    const double* path[64];
    int64_t nodes = 0;
    for (int64_t p = block; p > 0; p -= p & -p) path[nodes++] = node_.data() + p * width_;
    int64_t c = 0;
    for (; c + CHUNK <= width_; c += CHUNK) {
      double sum[CHUNK] = {};
      for (int64_t k = 0; k < nodes; ++k) {
#pragma omp simd
        for (int64_t j = 0; j < CHUNK; ++j) sum[j] += path[k][c + j];
      }
      for (int64_t j = 0; j < CHUNK; ++j) acc[c + j] = sum[j];
    }
    for (; c < width_; ++c) {
      double sum = 0.0;
      for (int64_t k = 0; k < nodes; ++k) sum += path[k][c];
      acc[c] = sum;
    }
  }

 private:
  int64_t blocks_, width_;
  std::vector<double> node_;
};

template <typename T>
inline bool counts(T key, T x, bool strict) {
  return strict ? key < x : key <= x;
}

// The pairs inside each block, handed to emit(position, sums, true); `later`: over q >= p instead of
// q <= p, the keys compared as without it.
template <typename T, typename Rows, typename Emit>
void block_pairs(const T* key, const T* x, bool strict, bool transpose, const Rows& rows, int64_t length,
                 int64_t width, int64_t block, Emit emit, bool later = false) {
  std::vector<double> acc(width);
  for (int64_t start = 0; start < length; start += block) {
    const int64_t end = std::min(start + block, length);
    for (int64_t p = start; p < end; ++p) {
      std::fill(acc.begin(), acc.end(), 0.0);
      const bool after = transpose || later;
      const int64_t lo = after ? p : start, hi = after ? end : p + 1;
      for (int64_t q = lo; q < hi; ++q) {
        if (transpose ? counts(key[p], x[q], strict) : counts(key[q], x[p], strict)) rows.add(q, acc.data());
      }
      emit(p, acc.data(), true);
    }
  }
}

// A row's sums across blocks, as the walk finds them: in score order, rounded to T, and where each
// position's row lies (rank). Kept per thread and reused from row to row.
template <typename T>
struct WalkRows {
  std::unique_ptr<T[]> rows;  // uninitialised: the walk writes every row before it is read
  int64_t capacity = 0;
  std::vector<int64_t> rank;
  std::vector<T> key_sorted, x_sorted;  // the compared scores in their walk order: read in sequence

  void reserve(int64_t length, int64_t width) {
    if (length * width > capacity) {
      capacity = length * width;
      rows.reset(new T[capacity]);
    }
    rank.resize(length);
    key_sorted.resize(length);
    x_sorted.resize(length);
  }
};

// One row's sums, handed to emit(position, inside (double[width]), across (T[width])) once per
// position, in time order: the pairs inside its block and those across blocks. transpose = false: the
// positions are the thresholds', S_i over keys j ≤ i; true: the keys', over thresholds i ≥ j. The walk
// visits positions in score order, so it writes its rows one after the other into `walked` (not into
// the outputs, a random read-modify-write of every output row); the pass over the blocks then reads
// them back by rank, ahead of use, and each output row is written once, in order.
template <typename T, typename Rows, typename Emit>
void dominance_row(const T* key, const int64_t* key_order, const T* x, const int64_t* x_order, bool strict,
                   bool transpose, const Rows& rows, int64_t length, int64_t width, int64_t block, Emit emit,
                   WalkRows<T>& walked) {
  walked.reserve(length, width);
  T *key_sorted = walked.key_sorted.data(), *x_sorted = walked.x_sorted.data();
  for (int64_t k = 0; k < length; ++k) key_sorted[k] = key[key_order[k]];
  for (int64_t q = 0; q < length; ++q) x_sorted[q] = x[x_order[q]];
  std::vector<double> acc(width);
  const int64_t blocks = (length + block - 1) / block;
  BlockTree tree(blocks, width);
  std::vector<double> row(width);
  int64_t written = 0;
  auto keep = [&](int64_t p) {
    T* target = walked.rows.get() + written * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) target[c] = static_cast<T>(acc[c]);
    walked.rank[p] = written++;
  };
  if (!transpose) {  // up the scores: keys below a threshold are in the tree when it reads
    int64_t k = 0;
    for (int64_t q = 0; q < length; ++q) {
      const int64_t i = x_order[q];
      while (k < length && counts(key_sorted[k], x_sorted[q], strict)) {
        if (k + AHEAD < length) rows.prefetch(key_order[k + AHEAD]);
        const int64_t j = key_order[k++];
        std::fill(row.begin(), row.end(), 0.0);
        rows.add(j, row.data());
        tree.add(j / block, row.data());
      }
      tree.before(i / block, acc.data());
      keep(i);
    }
  } else {  // down the scores: thresholds above a key are in the tree (by reversed block) when it reads
    int64_t q = length - 1;
    for (int64_t k = length - 1; k >= 0; --k) {
      const int64_t j = key_order[k];
      while (q >= 0 && counts(key_sorted[k], x_sorted[q], strict)) {
        if (q >= AHEAD) rows.prefetch(x_order[q - AHEAD]);
        const int64_t i = x_order[q--];
        std::fill(row.begin(), row.end(), 0.0);
        rows.add(i, row.data());
        tree.add(blocks - 1 - i / block, row.data());
      }
      tree.before(blocks - 1 - j / block, acc.data());
      keep(j);
    }
  }
  const T* across = walked.rows.get();
  const int64_t* rank = walked.rank.data();
  block_pairs(key, x, strict, transpose, rows, length, width, block, [&](int64_t p, const double* inside, bool) {
    if (p + AHEAD < length) prefetch_row(across + rank[p + AHEAD] * width, width, 0);
    emit(p, inside, across + rank[p] * width);
  });
}

// Plain sums: out (length, width) = S.
template <typename T>
void sums_rows(const T* key, const int64_t* key_order, const T* x, const int64_t* x_order, int64_t strict,
               int64_t transpose, const T* table, T* out, int64_t length, int64_t width, int64_t block,
               int64_t row_begin, int64_t row_end) {
  WalkRows<T> walked;
  for (int64_t n = row_begin; n < row_end; ++n) {
    const int64_t at = n * length;
    T* rout = out + at * width;
    auto emit = [&](int64_t p, const double* inside, const T* across) {
      T* target = rout + p * width;
#pragma omp simd
      for (int64_t c = 0; c < width; ++c) target[c] = static_cast<T>(inside[c] + across[c]);
    };
    const TableRows<T> rows{table + at * width, width};
    dominance_row(key + at, key_order + at, x + at, x_order + at, strict != 0, transpose != 0, rows, length, width,
                  block, emit, walked);
  }
}

// Sums of PairRows, written apart: sum_u, sum_score_u (N, length, dim), sum_first, sum_second (N, length).
template <typename T>
void pair_rows(const T* key, const int64_t* key_order, const T* x, const int64_t* x_order, int64_t strict,
               int64_t transpose, const T* u, const T* scale, const T* score, const T* first, const T* second,
               T* sum_u, T* sum_score_u, T* sum_first, T* sum_second, int64_t length, int64_t dim, int64_t block,
               int64_t row_begin, int64_t row_end) {
  WalkRows<T> walked;
  for (int64_t n = row_begin; n < row_end; ++n) {
    const int64_t at = n * length;
    T *out_u = sum_u + at * dim, *out_score_u = sum_score_u + at * dim;
    auto emit = [&](int64_t p, const double* inside, const T* across) {
      T *target = out_u + p * dim, *target_score = out_score_u + p * dim;
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) {
        target[c] = static_cast<T>(inside[c] + across[c]);
        target_score[c] = static_cast<T>(inside[dim + c] + across[dim + c]);
      }
      sum_first[at + p] = static_cast<T>(inside[2 * dim] + across[2 * dim]);
      sum_second[at + p] = static_cast<T>(inside[2 * dim + 1] + across[2 * dim + 1]);
    };
    const PairRows<T> rows{u + at * dim, scale == nullptr ? nullptr : scale + at, score + at, first + at, second + at,
                           dim, 2 * dim + 2};
    dominance_row(key + at, key_order + at, x + at, x_order + at, strict != 0, transpose != 0, rows, length,
                  2 * dim + 2, block, emit, walked);
  }
}

// Weighted combinations of the sums at several thresholds (ReLU-bump's hat windows):
//   outs[c]_i = Σ_{terms k of combination c} coef_k,i · S(threshold_k)_i[block_k · width : (block_k + 1) · width]
// with S over the whole table row (table_width columns); `later`: S over the rows j >= i instead of
// j <= i (the backward pass's keys, without reversing time in memory: the tree's blocks count down). coefs[k] (N, length) in double, null: one. The
// terms cancel where a window is empty ((c − b) S(c − b) − 2c S(c) + (b + c) S(c + b) with equal
// S), exactly in double only: float32 outputs are summed in a double copy of the row and rounded once.
template <typename T>
void combined_rows(const T* key, const int64_t* key_order, int64_t n_thresholds, const T* const* xs,
                   const int64_t* const* x_orders, const int64_t* strict, const T* table, int64_t table_width,
                   int64_t width, int64_t n_terms, const int64_t* term_out, const int64_t* term_threshold,
                   const int64_t* term_block, const double* const* coefs, int64_t n_outs, T* const* outs,
                   int64_t length, int64_t block, int64_t later, int64_t row_begin, int64_t row_end) {
  constexpr bool in_place = sizeof(T) == sizeof(double);
  std::vector<double> copy(in_place ? 0 : n_outs * length * width);
  for (int64_t n = row_begin; n < row_end; ++n) {
    const int64_t at = n * length;
    std::vector<double*> sums_of(n_outs);
    for (int64_t o = 0; o < n_outs; ++o) {
      sums_of[o] = in_place ? reinterpret_cast<double*>(outs[o] + at * width) : copy.data() + o * length * width;
      std::fill(sums_of[o], sums_of[o] + length * width, 0.0);
    }
    auto emit = [&](int64_t h, int64_t p, const double* sums) {
      for (int64_t k = 0; k < n_terms; ++k) {
        if (term_threshold[k] != h) continue;
        const double coef = coefs[k] == nullptr ? 1.0 : coefs[k][at + p];
        const double* part = sums + term_block[k] * width;
        double* target = sums_of[term_out[k]] + p * width;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) target[c] += coef * part[c];
      }
    };
    const TableRows<T> rows{table + at * table_width, table_width};
    for (int64_t h = 0; h < n_thresholds; ++h) {
      block_pairs(key + at, xs[h] + at, strict[h] != 0, false, rows, length, table_width, block,
                  [&](int64_t p, const double* sums, bool) { emit(h, p, sums); }, later != 0);
    }
    // Across blocks, one walk up the keys for every threshold row: before a key joins the tree, each
    // row's thresholds that do not count it read (in their ascending order), so each key is added once.
    const int64_t blocks = (length + block - 1) / block;
    auto block_of = [&](int64_t p) { return later != 0 ? blocks - 1 - p / block : p / block; };
    BlockTree tree(blocks, table_width);
    std::vector<double> row(table_width), acc(table_width);
    std::vector<int64_t> next(n_thresholds, 0);
    const int64_t* key_sorted = key_order + at;
    // the compared scores in walk order (read in sequence, not through the orders)
    std::vector<T> key_scores(length), x_scores(n_thresholds * length);
    for (int64_t k = 0; k < length; ++k) key_scores[k] = key[at + key_sorted[k]];
    for (int64_t h = 0; h < n_thresholds; ++h) {
      for (int64_t q = 0; q < length; ++q) x_scores[h * length + q] = xs[h][at + x_orders[h][at + q]];
    }
    for (int64_t k = 0; k <= length; ++k) {  // k == length: every key is in, the rest read
      for (int64_t h = 0; h < n_thresholds; ++h) {
        const T* x_sorted = x_scores.data() + h * length;
        const int64_t* x_order = x_orders[h] + at;
        const bool strict_h = strict[h] != 0;
        while (next[h] < length && (k == length || !counts(key_scores[k], x_sorted[next[h]], strict_h))) {
          if (next[h] + AHEAD < length) {  // its output rows and coefficients, in sorted order: random
            const int64_t ahead = x_order[next[h] + AHEAD];
            for (int64_t o = 0; o < n_outs; ++o) prefetch_row(sums_of[o] + ahead * width, width, 1);
            for (int64_t t = 0; t < n_terms; ++t) {
              if (term_threshold[t] == h && coefs[t] != nullptr) __builtin_prefetch(coefs[t] + at + ahead, 0);
            }
          }
          const int64_t i = x_order[next[h]++];
          tree.before(block_of(i), acc.data());
          emit(h, i, acc.data());
        }
      }
      if (k == length) break;
      if (k + AHEAD < length) rows.prefetch(key_sorted[k + AHEAD]);
      const int64_t j = key_sorted[k];
      std::fill(row.begin(), row.end(), 0.0);
      rows.add(j, row.data());
      tree.add(block_of(j), row.data());
    }
    if (!in_place) {
      for (int64_t o = 0; o < n_outs; ++o) std::copy(sums_of[o], sums_of[o] + length * width, outs[o] + at * width);
    }
  }
}

// The tied pairs (causal.py's tied_pairs): in each row the positions j <= i with x_i == key_j, from
// both ascending orders in one merged walk. Without `offsets`: counts[n] = the row's pairs before the
// j <= i filter (the run of keys equal to each x_i: O(length) whatever the ties, for the caller's
// budget). With them (each row's first slot): the pairs written as flat indices (n·length + i,
// n·length + j), the slots of pairs filtered out left as they were.
template <typename T>
void tied_rows(const T* key, const int64_t* key_order, const T* x, const int64_t* x_order, int64_t* counts,
               const int64_t* offsets, int64_t* query_out, int64_t* key_out, int64_t length, int64_t row_begin,
               int64_t row_end) {
  for (int64_t n = row_begin; n < row_end; ++n) {
    const int64_t at = n * length;
    const T *row_key = key + at, *row_x = x + at;
    const int64_t *ko = key_order + at, *xo = x_order + at;
    int64_t first = 0, end = 0, found = 0, slot = offsets == nullptr ? 0 : offsets[n];
    for (int64_t q = 0; q < length; ++q) {
      const int64_t i = xo[q];
      const T xi = row_x[i];
      while (first < length && row_key[ko[first]] < xi) ++first;  // both ascend: each pointer moves on only
      end = std::max(end, first);
      while (end < length && row_key[ko[end]] == xi) ++end;
      if (end == first || !(row_key[ko[first]] == xi)) continue;
      if (offsets == nullptr) {
        found += end - first;
        continue;
      }
      for (int64_t r = first; r < end; ++r, ++slot) {
        if (ko[r] > i) continue;
        query_out[slot] = at + i;
        key_out[slot] = at + ko[r];
      }
    }
    if (offsets == nullptr) counts[n] = found;
  }
}

}  // namespace

// Every array contiguous, rows n in [row_begin, row_end) of N (over `threads` threads, parallel_rows.h): key, x (N, length) with key_order,
// x_order their ascending orders; table, out (N, length, width).
#define ATTNLAB_SUMS(NAME, T) \
  void NAME(const T* key, const int64_t* key_order, const T* x, const int64_t* x_order, int64_t strict, \
            int64_t transpose, const T* table, T* out, int64_t length, int64_t width, int64_t block, \
            int64_t row_begin, int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      sums_rows(key, key_order, x, x_order, strict, transpose, table, out, length, width, block, begin, end); \
    }); \
  }

// As ATTNLAB_SUMS for the rows [scale u, scale score u, first, second]: u (N, length, dim), the rest
// (N, length); scale may be null (one); the sums come apart (pair_rows).
#define ATTNLAB_PAIRS(NAME, T) \
  void NAME(const T* key, const int64_t* key_order, const T* x, const int64_t* x_order, int64_t strict, \
            int64_t transpose, const T* u, const T* scale, const T* score, const T* first, const T* second, \
            T* sum_u, T* sum_score_u, T* sum_first, T* sum_second, int64_t length, int64_t dim, int64_t block, \
            int64_t row_begin, int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      pair_rows(key, key_order, x, x_order, strict, transpose, u, scale, score, first, second, sum_u, sum_score_u, \
                sum_first, sum_second, length, dim, block, begin, end); \
    }); \
  }

// As ATTNLAB_SUMS for n_thresholds threshold rows xs[h] (their orders x_orders[h], strict[h]), a table of
// table_width columns and n_outs outputs (N, length, width); the terms' arrays have n_terms entries.
#define ATTNLAB_COMBINED(NAME, T) \
  void NAME(const T* key, const int64_t* key_order, int64_t n_thresholds, const T* const* xs, \
            const int64_t* const* x_orders, const int64_t* strict, const T* table, int64_t table_width, \
            int64_t width, int64_t n_terms, const int64_t* term_out, const int64_t* term_threshold, \
            const int64_t* term_block, const double* const* coefs, int64_t n_outs, T* const* outs, int64_t length, \
            int64_t block, int64_t later, int64_t row_begin, int64_t row_end, int64_t threads) { \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      combined_rows(key, key_order, n_thresholds, xs, x_orders, strict, table, table_width, width, n_terms, term_out, \
                    term_threshold, term_block, coefs, n_outs, outs, length, block, later, begin, end); \
    }); \
  }

#define ATTNLAB_TIED(NAME, T) \
  void NAME(const T* key, const int64_t* key_order, const T* x, const int64_t* x_order, int64_t* counts, \
            const int64_t* offsets, int64_t* query_out, int64_t* key_out, int64_t length, int64_t dim, \
            int64_t row_begin, int64_t row_end, int64_t threads) { \
    (void)dim; \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      tied_rows(key, key_order, x, x_order, counts, offsets, query_out, key_out, length, begin, end); \
    }); \
  }

extern "C" {
ATTNLAB_TIED(tied_pairs_f32, float)
ATTNLAB_TIED(tied_pairs_f64, double)
ATTNLAB_SUMS(dominance_sums_f32, float)
ATTNLAB_SUMS(dominance_sums_f64, double)
ATTNLAB_PAIRS(pair_sums_f32, float)
ATTNLAB_PAIRS(pair_sums_f64, double)
ATTNLAB_COMBINED(combined_sums_f32, float)
ATTNLAB_COMBINED(combined_sums_f64, double)
}
