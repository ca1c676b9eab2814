"""A packed batch through the whole classifier gives each sequence the logits it gets in a padded
batch (float64, eval mode), for every backend and each position scheme; what cannot be packed is
refused by name."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import PackedLayout, available_backends
from attnlab.models.classifier import SequenceClassifier

LENGTHS, ROWS = [6, 2, 1, 9, 3, 4], [[0, 1, 2], [3], [5, 4]]  # rows of 9 slots


def _model(attention: str, **options) -> SequenceClassifier:
    torch.manual_seed(0)
    options = {"dim": 12, "depth": 2, "num_heads": 3, "mlp_dim": 16, "max_len": 16, **options}
    if attention == "performer":
        from functools import partial

        from attnlab.attention import build_attention

        attention = partial(build_attention, "performer", redraw_interval=None)
    return SequenceClassifier(vocab_size=11, num_classes=3, attention=attention, **options).double().eval()


def _batches(generator: torch.Generator):
    """The same sequences as a packed batch and as a padded one (in the layout's order)."""
    layout = PackedLayout.from_rows(LENGTHS, ROWS)
    packed = torch.randint(1, 11, (3, 9), generator=generator) * layout.row_mask
    ids = layout.unpack(packed)
    return packed, layout, ids, layout.mask


@pytest.mark.parametrize("attention", available_backends())
def test_packed_logits_equal_padded_for_every_backend(attention):
    model = _model(attention)
    packed, layout, ids, mask = _batches(torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(packed, packing=layout), model(ids, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "options",
    [
        {"positions": "sinusoidal", "pooling": "first"},
        {"positions": "rope", "short_conv": 3, "embed_norm": True},
        {"positions": "none", "dual": True},
    ],
    ids=["sinusoidal-first", "rope-short-conv", "dual"],
)
def test_packed_logits_equal_padded_for_each_model_option(options):
    model = _model("sliced_relu", **options)
    packed, layout, ids, mask = _batches(torch.Generator().manual_seed(2))
    if options.get("dual"):
        packed2, layout2, ids2, mask2 = _batches(torch.Generator().manual_seed(3))
        got = model(packed, input_ids2=packed2, packing=layout, packing2=layout2)
        torch.testing.assert_close(got, model(ids, mask, ids2, mask2), rtol=1e-10, atol=1e-10)
    else:
        torch.testing.assert_close(model(packed, packing=layout), model(ids, mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("pooling", "why"), [("cls", "prepends a learned token"), ("mean_all", "padded")])
def test_poolings_that_cannot_read_a_packed_batch_are_refused(pooling, why):
    model = _model("softmax", pooling=pooling)
    packed, layout, _, _ = _batches(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=f"pooling='{pooling}' cannot read a packed batch.*{why}"):
        model(packed, packing=layout)


def test_a_packed_sequence_longer_than_max_len_is_refused():
    model = _model("softmax", max_len=8)
    packed, layout, _, _ = _batches(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="sequence length 9 exceeds the model's max_len=8"):
        model(packed, packing=layout)
