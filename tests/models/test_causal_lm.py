"""The causal LM: no output sees the future (every causal backend); the others are refused by name."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import (
    AttentionLayer,
    Capabilities,
    UnsupportedAttentionError,
    available_backends,
    registry,
)
from attnlab.attention.registry import register_backend
from attnlab.data.packing import document_layout
from attnlab.errors import UserError
from attnlab.models.causal_lm import CausalLM, NoCausalAttentionError, causal_backends

VOCAB = 24


def _model(attn: str, **kwargs) -> CausalLM:
    torch.manual_seed(0)
    options = dict(dim=16, depth=2, num_heads=2, max_len=40)
    return CausalLM(VOCAB, attn, **{**options, **kwargs}).eval()


def test_the_causal_backends_are_the_registered_ones_that_accept_causal():
    builtin = {"softmax", "sliced_relu", "sliced_relu_bump", "linear", "performer"}
    assert builtin <= set(causal_backends()) <= set(available_backends())


@pytest.mark.parametrize("attn", causal_backends())
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_changing_later_tokens_never_changes_earlier_outputs(attn, positions):
    model = _model(attn, positions=positions)
    ids = torch.randint(1, VOCAB, (3, 33))
    with torch.no_grad():
        before = model(ids)
        for i in (0, 7, 31):
            changed = ids.clone()
            changed[:, i + 1 :] = torch.randint(1, VOCAB, changed[:, i + 1 :].shape)
            after = model(changed)
            torch.testing.assert_close(after[:, : i + 1], before[:, : i + 1], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(after[:, i + 1 :], before[:, i + 1 :])  # the future still counts
    assert before.shape == (3, 33, VOCAB)


@pytest.mark.parametrize("attn", causal_backends())
def test_a_right_padded_batch_gives_each_sequence_its_own_outputs(attn):
    model = _model(attn)
    long, short = torch.randint(1, VOCAB, (1, 20)), torch.randint(1, VOCAB, (1, 12))
    batch = torch.zeros(2, 20, dtype=torch.long)
    batch[0], batch[1, :12] = long[0], short[0]
    mask = batch != 0
    with torch.no_grad():
        out = model(batch, mask)
        torch.testing.assert_close(out[1, :12], model(short)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[0], model(long)[0], atol=1e-5, rtol=1e-5)


def test_left_padding_is_refused():
    mask = torch.tensor([[False, True, True], [True, True, True]])
    with pytest.raises(ValueError, match="right padding"):
        _model("softmax")(torch.ones(2, 3, dtype=torch.long), mask)


@pytest.fixture
def bidirectional_only():
    """A registered backend without a causal form (every built-in has one now), removed afterwards."""
    saved = dict(registry._BACKENDS)

    class Bidirectional(AttentionLayer):
        capabilities = Capabilities(causal=False, reasons={"causal": "every query sees every key"})

        def attend(self, q, k, v, key_padding_mask):
            return v.mean(dim=2, keepdim=True).expand_as(v)

    register_backend("bidirectional_only")(Bidirectional)
    yield "bidirectional_only"
    registry._BACKENDS.clear()
    registry._BACKENDS.update(saved)


def test_a_backend_without_causal_form_is_named_with_those_that_have_one(bidirectional_only):
    assert bidirectional_only in available_backends() and bidirectional_only not in causal_backends()
    with pytest.raises(NoCausalAttentionError) as caught:
        _model(bidirectional_only)
    message = str(caught.value)
    assert (
        "backend 'bidirectional_only' cannot serve this request: causal: every query sees every key"
        in message
    )
    assert "backends with a causal form: " + ", ".join(causal_backends()) in message
    assert isinstance(caught.value, UnsupportedAttentionError) and isinstance(caught.value, UserError)


def test_mlp_width_follows_the_model_width_unless_given():
    assert _model("softmax", dim=32).encoder.blocks[0].mlp[0].out_features == 64
    assert _model("softmax", dim=32, mlp_ratio=4).encoder.blocks[0].mlp[0].out_features == 128
    assert _model("softmax", dim=32, mlp_dim=40).encoder.blocks[0].mlp[0].out_features == 40
    with pytest.raises(ValueError, match="mlp_ratio must be > 0"):
        _model("softmax", mlp_ratio=0)
    with pytest.raises(ValueError, match="positions='alibi' is not supported; choose one of"):
        _model("softmax", positions="alibi")
    with pytest.raises(ValueError, match="exceeds the model's max_len=40"):
        _model("softmax")(torch.ones(1, 41, dtype=torch.long))


@pytest.mark.parametrize("attn", causal_backends())
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_documents_packed_in_a_block_each_get_their_outputs_alone(attn, positions):
    """``packing``: a block of several documents gives each the logits it has on its own (float64)."""
    model = _model(attn, positions=positions).double()
    eos, pad = 2, 0
    docs = [[5, 9, 7, eos], [11, 4, 6, 8, 13, eos], [3, 14], [10, 12, eos], [15, 16, 17, 18, 19, 20, 21]]
    blocks = torch.tensor([docs[0] + docs[1] + docs[2], docs[3] + docs[4] + [pad, pad]])
    layout = document_layout(blocks, eos, pad)
    assert layout.num_sequences == 5 and layout.positions[0, 4].item() == 0  # a new document at 0
    with torch.no_grad():
        out = model(blocks, blocks != pad, packing=layout)
        starts = {0: 0, 1: 4, 2: 10, 3: 0, 4: 3}
        for n, doc in enumerate(docs):
            row, start = int(n > 2), starts[n]
            alone = model(torch.tensor([doc]))[0]
            torch.testing.assert_close(out[row, start : start + len(doc)], alone, atol=1e-9, rtol=1e-9)
