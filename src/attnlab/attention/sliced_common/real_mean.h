// The mean of a row's real values, shared by the sorted ops' C++ kernels (sliced_relu/cpu_kernels.cpp,
// sliced_relu_bump/cpu_kernels.cpp). Plain C++, included by file; the builds (ninja, through
// attnlab.attention.common.native) track it as a dependency of both.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

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
