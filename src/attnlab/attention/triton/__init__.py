"""Triton kernels for the sliced ReLU / ReLU-bump ops and causal linear attention (CUDA path).

The torch ops in ``attnlab.attention`` stay the reference and the CPU path; the public ops take
``impl="auto" | "triton" | "torch"`` and come here for CUDA tensors (``auto``) or when asked
(``triton``; on CPU tensors only under ``TRITON_INTERPRET=1``, Triton's interpreter, which is how
the kernels are tested without a GPU). Nothing here imports triton until a kernel is needed.
"""

from __future__ import annotations

from attnlab.attention.triton.runtime import IMPLS, TritonUnavailableError, resolve_impl

__all__ = ["IMPLS", "TritonUnavailableError", "resolve_impl"]
