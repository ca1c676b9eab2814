"""Running the Triton kernels (CUDA path): which implementation runs, loading the kernels, the
device probe and the first-use check. The kernels themselves sit in each family's folder
(``triton_kernels.py`` and its launcher ``triton.py``: sliced ReLU, ReLU-bump, causal linear).

The torch ops in ``attnlab.attention`` stay the reference and the CPU path; the public ops take
``impl="auto" | "triton" | "torch"`` and come here for CUDA tensors (``auto``) or when asked
(``triton``; on CPU tensors only under ``TRITON_INTERPRET=1``, Triton's interpreter, which is how
the kernels are tested without a GPU). Nothing here imports triton until a kernel is needed.
"""

from __future__ import annotations

from attnlab.attention.common.triton.runtime import TritonUnavailableError, triton_problem

__all__ = ["TritonUnavailableError", "triton_problem"]
