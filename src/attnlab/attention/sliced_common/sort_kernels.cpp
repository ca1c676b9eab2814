// Row-wise ascending sorts with their orders on the CPU (rows.py: sort_rows), as torch.sort(x, dim=1)
// gives them: NaN last, equal values in any order (here: in index order, a stable sort).
//
// The sliced ops sort every row of scores once or more per call; torch's CPU sort is a comparison
// sort of (value, index) pairs. Here the floats' bits
// are mapped to unsigned integers in the same order and sorted by digits of 11 bits, least significant
// first (three passes over a row of float32, six of float64, one histogram read for all of them, a
// pass skipped where every key shares its digit). Plain C++ without torch's headers
// (attnlab.attention.common.native builds it).

#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/parallel_rows.h"

namespace {

constexpr int DIGIT_BITS = 11;
constexpr int64_t BUCKETS = int64_t{1} << DIGIT_BITS;

template <typename T>
struct Bits;
template <>
struct Bits<float> {
  using type = uint32_t;
};
template <>
struct Bits<double> {
  using type = uint64_t;
};

// An unsigned key in the order of the values: negatives reversed below the positives, every NaN last.
template <typename T>
inline typename Bits<T>::type sort_key(T x) {
  using U = typename Bits<T>::type;
  constexpr U sign = U{1} << (8 * sizeof(U) - 1);
  if (x != x) return ~U{0};
  U bits;
  std::memcpy(&bits, &x, sizeof(U));
  return (bits & sign) ? ~bits : (bits | sign);
}

template <typename T>
void sort_rows(const T* x, T* sorted, int64_t* order, int64_t length, int64_t row_begin, int64_t row_end) {
  using U = typename Bits<T>::type;
  constexpr int passes = (8 * sizeof(U) + DIGIT_BITS - 1) / DIGIT_BITS;
  std::vector<U> keys(length), keys_next(length);
  std::vector<int64_t> index(length), index_next(length);
  std::vector<int64_t> counts(passes * BUCKETS);
  for (int64_t n = row_begin; n < row_end; ++n) {
    const T* row = x + n * length;
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < length; ++i) {
      const U key = sort_key(row[i]);
      keys[i] = key;
      index[i] = i;
      for (int p = 0; p < passes; ++p) ++counts[p * BUCKETS + ((key >> (p * DIGIT_BITS)) & (BUCKETS - 1))];
    }
    for (int p = 0; p < passes; ++p) {
      int64_t* count = counts.data() + p * BUCKETS;
      const U digit_of_first = (keys[0] >> (p * DIGIT_BITS)) & (BUCKETS - 1);
      if (count[digit_of_first] == length) continue;  // every key has this digit: the order stands
      int64_t start = 0;
      for (int64_t b = 0; b < BUCKETS; ++b) {
        const int64_t size = count[b];
        count[b] = start;
        start += size;
      }
      for (int64_t i = 0; i < length; ++i) {
        const int64_t at = count[(keys[i] >> (p * DIGIT_BITS)) & (BUCKETS - 1)]++;
        keys_next[at] = keys[i];
        index_next[at] = index[i];
      }
      keys.swap(keys_next);
      index.swap(index_next);
    }
    for (int64_t i = 0; i < length; ++i) {
      order[n * length + i] = index[i];
      sorted[n * length + i] = row[index[i]];
    }
  }
}

}  // namespace

// Every array contiguous, rows n in [row_begin, row_end) of N (over `threads` threads, parallel_rows.h): x, sorted (N, length), order (N, length).
#define ATTNLAB_SORT(NAME, T) \
  void NAME(const T* x, T* sorted, int64_t* order, int64_t length, int64_t dim, int64_t row_begin, int64_t row_end, \
            int64_t threads) { \
    (void)dim; \
    parallel_rows(row_begin, row_end, threads, [&](int64_t begin, int64_t end) { \
      if (length > 0) sort_rows(x, sorted, order, length, begin, end); \
    }); \
  }

extern "C" {
ATTNLAB_SORT(sort_rows_f32, float)
ATTNLAB_SORT(sort_rows_f64, double)
}
