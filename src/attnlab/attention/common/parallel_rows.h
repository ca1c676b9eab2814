// The row kernels' threads (attnlab.attention.common.native): rows [row_begin, row_end) split into one
// block per thread, run on the process's OpenMP team. The library links libgomp.so.1, which resolves to
// the one torch loaded, so the kernels and torch's CPU ops share one team of threads. A pool of their
// own would compete for the cores with torch's workers, which spin after each of torch's parallel ops
// (libgomp's wait before sleeping): on two cores the second thread of a kernel then did little.

#pragma once

#include <cstdint>

template <typename Body>
void parallel_rows(int64_t row_begin, int64_t row_end, int64_t threads, Body body) {
  const int64_t rows = row_end - row_begin;
  if (threads > rows) threads = rows;
  if (threads <= 1) {
    if (rows > 0) body(row_begin, row_end);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int64_t k = 0; k < threads; ++k) body(row_begin + rows * k / threads, row_begin + rows * (k + 1) / threads);
}
