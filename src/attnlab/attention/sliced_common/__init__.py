"""What sliced ReLU and sliced ReLU-bump share: exact O(T log T) time and O(T·D) memory.

The two families (``attnlab.attention.sliced_relu``, ``attnlab.attention.sliced_relu_bump``) are
the same idea, sums of a piecewise-linear kernel of ``s_i - t_j`` over keys sorted by score, so the
machinery lives here once and each family's folder holds only its own op, kernels and layer:

- ``rows``: the row helpers both the torch and the Triton paths use (sorting, centring, counts,
  prefix tables, the hat-window algebra, input checks);
- ``dispatch``: what the two public ops share around their implementations (Triton launch, empty
  batches); ``path``: the dense/sorted crossovers;
- ``dense`` / ``causal`` / ``dominance`` / ``merged``: the helpers of the dense O(T²) path and of
  the causal ops (divide and conquer over time);
- ``segments``: what the ops on packed rows share (segment runs, the sort by segment and score,
  per-segment centring and standardisation);
- ``decoding``: the sorted runs of recurrent decoding; ``scores``: Π and the score
  standardisation; ``layer``: the layer both sliced layers extend; ``triton_scores``: the sorts the
  Triton launchers start with; ``authors_reference``: the authors' layers written out (comparisons).

The sorted ops, in short.

The math is in docs/attention.md. Both kernels are piecewise linear in the score difference
``r = s_i - t_j``, so once the keys are sorted by ``t`` every query's sum splits into
"keys below ``s_i``" and "keys above ``s_i``", and each part is an affine function of ``s_i``
whose coefficients are prefix sums over the sorted keys::

    Σ_{t_j < s_i} (s_i - t_j) w_j = s_i · P_w[p_i] - P_tw[p_i],     p_i = #{j : t_j < s_i}

``p_i`` comes from ``torch.searchsorted``. The backward pass is the same computation with queries
and keys exchanged (queries sorted, prefix sums of the scaled output gradient, gathered at each
key's rank), written by hand in a ``torch.autograd.Function`` so that nothing of size T×T is
ever built and autograd does not keep the sort/cumsum intermediates alive.

Implementation notes (why the code looks the way it does):

- Everything runs on rows ``(N = B·H, T, D)`` kept in the ``(T, D)`` layout of the inputs; row
  gathers are ``index_select`` on the flattened tensor, much faster on CPU than ``gather``.
- Large fresh allocations are what costs most on CPU (page faults), so prefix tables are built
  in place (``cumsum_``) and results are written with ``out=`` or in-place ops where that is safe.
- Padded keys are sorted after every real key (score +inf) and carry zero weight; padded queries
  get score 0, so whatever sits in padded slots (huge values included) never reaches a real
  position. Padded values must be finite (0 · inf is NaN in any formulation).
- Kinks are differentiated like torch autograd does on the naive formula (``relu'(0) = 0``,
  ``abs'(0) = 0``): tied scores take part in neither side of a gradient sum, hence the separate
  "strictly below" and "strictly above" ranks.

Precision: sums are accumulated in float32 for half/bfloat16/float32 inputs (float64 for float64)
and the result is cast back. Prefix sums are differences of running totals: a window or a
tail sum ``P[b] - P[a]`` loses about ``|P| / |P[b] - P[a]|`` ulps, and ``s_i · P_w - P_tw`` loses
about ``|s_i|·|P_w| / |result|``. So that this does not depend on where the scores sit, each row's
scores are shifted by one constant (exact: see ``centre_scores``) and the tables hold centred
values (ReLU-bump: ``v - vbar``, with ``vbar`` times the hat mass added from float64 scalar tables).
What remains grows with T and with the scores' spread over the bump width. Measured float32
against float64 (relative error in norm) on CPU, where torch's float32 ``cumsum`` adds in double,
so every prefix sum is rounded once: sliced ReLU with standard-normal scores at T = 65,536, 3e-6
on the output and <= 2.3e-6 on the gradients, the same at a score offset of 1,000; ReLU-bump at
T = 16,384, b = 0.005, 5e-5 on the output and 4e-4 on dL/dv at offset 0 or 30
(``tests/attention/sliced_common/test_sorted.py`` prints the figures). On CUDA torch's ``cumsum`` adds in
float32, so this torch code loses more there (not measured: no GPU where this was written). The
Triton path (``attnlab.attention.sliced_relu_bump.triton``), which CUDA tensors take, does not difference
prefix sums inside a window: it sums each window's keys with their exact weights ``b − |s − t|``,
jumps over whole runs of keys with float64 prefix tables, and sums dL/db (whose per-query terms
cancel) in float64, so it keeps float32's own precision: at T = 512 with padding, b narrow, its
largest error is 5.6e-7 on dL/db and 1e-7 or below on the output and the other gradients, against
1e-2 for this code (``tests/attention/sliced_relu_bump/test_triton_precision.py``; the T = 2,048 and 4,096
cases there are ``slow``).
"""
