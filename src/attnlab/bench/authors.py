"""``attnlab bench authors``: how far attnlab's sliced layers are from the authors' published layers.

The authors' layers (SiwanB/Sliced_ReLU_Attention) are written out in
``attnlab.attention.sliced_common.authors_reference``; each figure compares one of them with attnlab's layer
holding the same weights (float64, eval mode unless said, random inputs x ~ N(0, 1)):

- ``authors vs token``: ‖authors − attnlab‖ / ‖attnlab‖ with attnlab's default layout (the paper's
  per-token Π); the authors' in-place reshape gives a different function;
- ``authors vs score_layout=authors``: the same with the option that reproduces it (float rounding);
- ``reshape fixed vs token``: the authors' layer with per-token rows against attnlab's default;
- ``|dscore_0/dx_1|``: the largest derivative of token 0's scores (all heads) with respect to
  token 1's input, a neighbour (0 when each score reads its own token);
- ``padding P -> P + 4``: ‖change‖ / ‖outputs‖ of the real tokens' outputs when a sequence of R real
  tokens padded with P tokens is padded with P + 4 instead: the authors' layer, the same with its
  reshape fixed (what is left is sliced ReLU's padding rule), attnlab's default, and attnlab as the
  authors' layer (``score_layout=authors``, and ``padding_rule=authors`` for sliced ReLU);
- ``train-mode output dropout``: ‖train − eval‖ / ‖eval‖ of the layer's output at ``--dropout``: the
  authors' bump drops nothing (``dropout_site=projection`` reproduces it), attnlab's default drops
  the attention output.

Defaults are the paper's MLM layer (1,024 wide, 64 heads for ReLU-bump; sliced ReLU with the same
shape) at T = 128, so the run takes seconds on a CPU.
"""

from __future__ import annotations

import torch

from attnlab.attention import build_attention
from attnlab.attention.sliced_common.authors_reference import (
    AuthorsSlicedReLU,
    AuthorsSlicedReLUBump,
    copy_into,
)
from attnlab.reporting.formats import markdown_table


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _layers(backend: str, args, *, fixed=False, layout="token", **options):
    """A transcription and attnlab's layer with its weights (sliced ReLU: the MLP Π)."""
    if backend == "sliced_relu":
        ref = AuthorsSlicedReLU(args.dim, args.heads, fixed=fixed)
    else:
        ref = AuthorsSlicedReLUBump(args.dim, args.heads, fixed=fixed)
    layer = build_attention(
        backend, args.dim, args.heads, score_layout=layout, padded_queries="attend", **options
    )
    ref, layer = ref.double().eval(), layer.double().eval()
    return ref, copy_into(layer, ref)


def _padding_change(layer, args, x) -> float:
    """Real outputs with P padded tokens against P + 4."""
    real, pad = args.real_tokens, args.padding
    masks = []
    for total in (real + pad, real + pad + 4):
        mask = torch.zeros(1, total, dtype=torch.bool)
        mask[:, :real] = True
        masks.append(mask)
    with torch.no_grad():
        short = layer(x[:, : real + pad], masks[0])[:, :real]
        long = layer(x[:, : real + pad + 4], masks[1])[:, :real]
    return _relative(long, short)


def _neighbour_derivative(layer, x) -> float:
    """max |∂ score_0 / ∂ x_1| over heads and input channels, through the layer's own score map."""
    from attnlab.attention.sliced_common.scores import slice_tokens

    x = x[:, :16].clone().requires_grad_(True)
    scores = slice_tokens(layer.slicer, layer.heads(x)[0], layer.score_layout)  # (1, H, T)
    rows = [torch.autograd.grad(scores[0, h, 0], x, retain_graph=True)[0] for h in range(scores.shape[1])]
    return max(row[0, 1].abs().max().item() for row in rows)


def _dropout_effect(backend: str, args, site: str, x) -> float:
    layer = build_attention(backend, args.dim, args.heads, dropout=args.dropout, dropout_site=site).double()
    with torch.no_grad():
        layer.eval()
        clean = layer(x)
        layer.train()
        torch.manual_seed(args.seed)
        noisy = layer(x)
    return _relative(noisy, clean)


def figures(args) -> list[tuple[str, str, str]]:
    """(figure, sliced ReLU, ReLU-bump) rows, each cell a number written with 3 significant digits."""
    torch.manual_seed(args.seed)
    x = torch.randn(1, max(args.seq_len, args.real_tokens + args.padding + 4), args.dim, dtype=torch.float64)
    xs = x[:, : args.seq_len]
    cells: dict[str, list[str]] = {}

    def put(name: str, value: float) -> None:
        cells.setdefault(name, []).append(f"{value:.3g}")

    for backend in ("sliced_relu", "sliced_relu_bump"):
        relu = backend == "sliced_relu"
        rule = {"padding_rule": "authors"} if relu else {}
        torch.manual_seed(args.seed)
        ref, token = _layers(backend, args)
        torch.manual_seed(args.seed)
        _, authors = _layers(backend, args, layout="authors", **rule)
        torch.manual_seed(args.seed)
        fixed, _ = _layers(backend, args, fixed=True)
        with torch.no_grad():
            theirs = ref(xs)
            put("authors vs token (attnlab's default)", _relative(theirs, token(xs)))
            put("authors vs score_layout=authors", _relative(authors(xs), theirs))
            put("reshape fixed vs token", _relative(fixed(xs), token(xs)))
        put("|dscore_0/dx_1|, score_layout=authors", _neighbour_derivative(authors, x))
        put("|dscore_0/dx_1|, token", _neighbour_derivative(token, x))
        padding = f"padding {args.padding} -> {args.padding + 4}"
        put(f"{padding}: authors' layer", _padding_change(ref, args, x))
        put(f"{padding}: authors' layer, reshape fixed", _padding_change(fixed, args, x))
        put(f"{padding}: attnlab's default", _padding_change(token, args, x))
        put(f"{padding}: attnlab as the authors' layer", _padding_change(authors, args, x))
        dropout = f"train-mode output dropout p={args.dropout:g}"
        put(f"{dropout}: dropout_site=output", _dropout_effect(backend, args, "output", xs))
        put(f"{dropout}: dropout_site=projection", _dropout_effect(backend, args, "projection", xs))
    return [(name, *values) for name, values in cells.items()]


def run(args) -> None:
    print(
        f"attnlab vs the authors' layers: dim {args.dim}, {args.heads} heads, T = {args.seq_len}, "
        f"padding {args.real_tokens} real tokens, seed {args.seed} (float64)\n"
    )
    print(markdown_table(["figure", "sliced ReLU", "ReLU-bump"], figures(args)))
