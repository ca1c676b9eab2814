"""``short_conv``: a depthwise convolution before attention keeps causality, padding and decoding exact."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.models.causal_lm import CausalLM, causal_backends
from attnlab.models.classifier import SequenceClassifier
from attnlab.models.short_conv import ShortConv

F64 = torch.float64
RECURRENT = causal_backends()  # every causal backend decodes (attnlab.attention.decoding)


def causal_lm(attn: str, short_conv: int, positions: str = "rope", **options) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(
        vocab_size=17, attention=partial(build_attention, attn, **options), dim=16, depth=2, num_heads=2,
        max_len=24, positions=positions, short_conv=short_conv,
    )  # fmt: skip
    with torch.no_grad():  # away from the identity start, so the taps do mix neighbours
        for block in model.encoder.blocks:
            if block.short_conv is not None:
                block.short_conv.weight.normal_(0, 0.5)
    return model.double().eval()


@pytest.mark.parametrize("attn", causal_backends())
def test_causal_models_see_no_future_token(attn):
    model = causal_lm(attn, short_conv=3)
    ids = torch.randint(1, 17, (2, 20), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    for cut in (0, 5, 18):
        changed = ids.clone()
        changed[:, cut + 1 :] = (changed[:, cut + 1 :] + 7) % 16 + 1
        other = model(changed)
        torch.testing.assert_close(other[:, : cut + 1], logits[:, : cut + 1], rtol=0, atol=1e-10)
        assert not torch.allclose(other[:, cut + 1 :], logits[:, cut + 1 :])


@pytest.mark.parametrize("attn", RECURRENT)
@pytest.mark.parametrize("positions", ["rope", "learned"])
@pytest.mark.parametrize("short_conv", [0, 3])
def test_step_by_step_decoding_equals_the_parallel_forward(attn, positions, short_conv):
    """The conv keeps its last k−1 inputs; the attention its own state (float64, every position)."""
    options = {"normaliser": "mass"} if attn == "sliced_relu_bump" else {}
    model = causal_lm(attn, short_conv, positions, **options)
    ids = torch.randint(1, 17, (2, 13), generator=torch.Generator().manual_seed(2))
    parallel = model(ids)
    state = None
    for t in range(ids.shape[1]):
        logits, state = model.step(ids[:, t], state)
        torch.testing.assert_close(logits, parallel[:, t], rtol=1e-9, atol=1e-9)


def test_a_new_short_conv_starts_as_the_identity():
    """Initialised to pass the current token through: the model starts where the one without it does."""
    build = lambda k: CausalLM(vocab_size=17, attention="linear", dim=16, depth=2, max_len=24, short_conv=k)  # noqa: E731
    plain, conv = build(0).double().eval(), build(4).double().eval()
    missing, unexpected = conv.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(".short_conv." in key for key in missing)
    ids = torch.randint(1, 17, (2, 9))
    torch.testing.assert_close(conv(ids), plain(ids))
    x = torch.randn(2, 7, 5)
    torch.testing.assert_close(ShortConv(5, 3, causal=False)(x), x)


@pytest.mark.parametrize("attn", ["softmax", "sliced_relu", "sliced_relu_bump", "linear"])
def test_padded_positions_leak_nothing_into_real_ones(attn):
    """A padded batch gives, at real positions, what each sequence gives alone (centred taps)."""
    torch.manual_seed(0)
    model = SequenceClassifier(
        vocab_size=11, num_classes=3, attention=attn, dim=16, depth=2, num_heads=2, max_len=16,
        positions="rope", dropout=0.0, short_conv=3,
    ).double().eval()  # fmt: skip
    with torch.no_grad():
        for block in model.encoder.blocks:
            block.short_conv.weight.normal_(0, 0.5)
    ids = torch.randint(1, 11, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    padded = ids.clone()
    padded[1, 6:] = 7  # whatever the padding holds
    batch = model.encode(padded, mask)
    torch.testing.assert_close(batch[1], model.encode(ids[1:, :6])[0], rtol=1e-9, atol=1e-10)


def test_bad_tap_counts_are_refused():
    with pytest.raises(ValueError, match="needs an odd number of taps"):
        ShortConv(8, 4, causal=False)
    with pytest.raises(ValueError, match=r"short_conv=1: a number of taps >= 2"):
        ShortConv(8, 1, causal=True)
    with pytest.raises(ValueError, match="no recurrent step"):
        ShortConv(8, 3, causal=False).step(torch.zeros(2, 8))


# ---- what the kernel can express: a recall head built by hand -----------------------------------------


def _hand_built_scores(inputs: torch.Tensor, spec, park_key: float, park_query: float):
    """One head's scores from each token and the token before it (what a short convolution provides):
    a value token that follows a key scores that key's id as a *key*; a key token scores its own id as
    a *query*; everything else is parked away from every other score."""
    previous = torch.nn.functional.pad(inputs, (1, 0))[:, :-1]
    is_key = (inputs >= 1) & (inputs < spec.first_value)
    follows_key = ~is_key & (previous >= 1) & (previous < spec.first_value)
    t = torch.where(follows_key, previous.to(F64), torch.full_like(inputs, park_key, dtype=F64))
    s = torch.where(is_key, inputs.to(F64), torch.full_like(inputs, park_query, dtype=F64))
    return s[:, None], t[:, None]


def _recall(out: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor, spec) -> float:
    asked = labels >= 0
    guess = out[:, 0, :, spec.first_value :].argmax(-1) + spec.first_value  # the value the head points at
    return float((guess[asked] == labels[asked]).float().mean())


def test_one_hand_built_bump_head_recalls_every_query_and_one_relu_head_cannot():
    """Given previous-token features, one ReLU-bump head with hand-set projections answers every MQAR
    query (its hat kernel picks the one key whose score equals the query's); a sliced ReLU head cannot:
    its weight ReLU(s - t) grows as t falls, so keys with smaller ids outweigh the one that matches."""
    from attnlab.attention.ops import sliced_relu_attention, sliced_relu_bump_attention
    from attnlab.data.mqar import MQARSpec, generate_mqar

    spec = MQARSpec(vocab_size=64, seq_len=64, num_kv_pairs=8)
    inputs, labels = (torch.from_numpy(a).long() for a in generate_mqar(spec, 32, seed=0))
    v = torch.nn.functional.one_hot(inputs, spec.vocab_size).to(F64)[:, None]  # values: the tokens

    s, t = _hand_built_scores(inputs, spec, park_key=-1e3, park_query=1e3)
    bump = sliced_relu_bump_attention(s, t, v, torch.tensor([0.5], dtype=F64), causal=True, normaliser="mass")
    assert _recall(bump, inputs, labels, spec) == 1.0

    # the most a ReLU head gets from the same features: matched keys just below their queries, the
    # rest parked above every query (zero weight)
    s, t = _hand_built_scores(inputs, spec, park_key=1e3, park_query=-1e3)
    relu = sliced_relu_attention(s + 0.5, t, v, causal=True)
    assert _recall(relu, inputs, labels, spec) < 0.5
