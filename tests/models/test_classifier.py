import math

import pytest
import torch
from torch import nn

from attnlab.models.classifier import SequenceClassifier, sinusoidal_positions


def make(**kwargs):
    torch.manual_seed(0)
    defaults = dict(
        vocab_size=20,
        num_classes=5,
        attention="softmax",
        dim=16,
        depth=2,
        num_heads=2,
        mlp_dim=32,
        max_len=32,
        dropout=0.0,
    )
    return SequenceClassifier(**{**defaults, **kwargs}).eval()


@pytest.mark.parametrize("attention", ["softmax", "sliced_relu", "sliced_relu_bump", "linear"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "first"])
@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope", "none"])
def test_padding_does_not_change_the_prediction(attention, pooling, positions):
    model = make(attention=attention, pooling=pooling, positions=positions)
    ids = torch.randint(1, 20, (1, 9))
    alone = model(ids)
    padded = torch.cat([ids, torch.randint(1, 20, (1, 6))], dim=1)  # junk in the padded slots
    mask = torch.zeros(1, 15, dtype=torch.bool)
    mask[:, :9] = True
    torch.testing.assert_close(model(padded, mask), alone, atol=1e-5, rtol=1e-5)


def test_dual_model_uses_both_documents():
    model = make(dual=True)
    a, b = torch.randint(1, 20, (2, 7)), torch.randint(1, 20, (2, 5))
    out = model(a, None, b, None)
    assert out.shape == (2, 5)
    assert not torch.allclose(out, model(a, None, torch.randint(1, 20, (2, 5)), None))
    with pytest.raises(ValueError, match="input_ids2"):
        model(a)


def test_too_long_and_bad_choices_are_named():
    with pytest.raises(ValueError, match="max_len=32"):
        make()(torch.ones(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="positions='alibi'.*learned, sinusoidal, rope, none"):
        make(positions="alibi")
    with pytest.raises(ValueError, match="pooling='max'.*mean, mean_all, cls, first"):
        make(pooling="max")
    with pytest.raises(ValueError, match="head_activation='tanh'.*gelu, relu"):
        make(head_activation="tanh")
    with pytest.raises(ValueError, match="pair_features='dot'.*nli, concat"):
        make(pair_features="dot")
    with pytest.raises(ValueError, match=r"head_dims=\[0\]"):
        make(head_dims=[0])
    with pytest.raises(ValueError, match="head_dropout"):
        make(head_dropout=1.0)


def test_sinusoidal_table_hand_values():
    """Row p, channels 2i / 2i+1: sin / cos of p / 10000^(2i/d) (LRA's sinusoidal_init)."""
    table = sinusoidal_positions(50, 6)
    assert table.shape == (50, 6)
    for p, i in [(0, 0), (1, 0), (7, 1), (49, 2)]:
        angle = p / 10000 ** (2 * i / 6)
        assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    odd = sinusoidal_positions(4, 5)  # odd width: the last channel is a sine
    assert odd[3, 4].item() == pytest.approx(math.sin(3 / 10000 ** (4 / 5)), abs=1e-6)


def test_sinusoidal_positions_are_fixed_and_order_matters():
    model = make(positions="sinusoidal", pooling="mean")
    assert not any("pos" in name for name, _ in model.named_parameters())
    assert "pos_table" not in model.state_dict()  # rebuilt from max_len and dim, never saved
    ids = torch.randint(1, 20, (1, 9))
    flipped = ids.flip(1)
    assert not torch.allclose(model(ids), model(flipped), atol=1e-4)  # mean pooling alone would not see order
    cls = make(positions="sinusoidal", pooling="cls")
    assert cls.pos_table.shape == (1, 33, 16)  # the CLS token takes position 0


def test_first_token_pooling_reads_token_zero_without_a_cls_token():
    model = make(pooling="first")
    assert model.cls is None
    ids = torch.randint(1, 20, (2, 9))
    hidden = {}
    model.encoder.register_forward_hook(lambda m, i, out: hidden.setdefault("x", out))
    logits = model(ids)
    assert hidden["x"].shape[1] == 9
    torch.testing.assert_close(logits, model.head(hidden["x"][:, 0]))


def test_qkv_dim_reaches_every_attention_layer_and_dropouts_stay_apart():
    model = make(dim=16, num_heads=4, qkv_dim=8, dropout=0.3, attn_dropout=0.2)
    for block in model.encoder.blocks:
        assert block.attn.qkv_dim == 8 and block.attn.dim == 16
        assert block.attn.dropout == 0.2  # attention dropout
        assert block.drop.p == 0.3 and block.mlp[2].p == 0.3  # residual and MLP dropout
    assert model.drop.p == 0.3
    assert model(torch.randint(1, 20, (2, 5))).shape == (2, 5)


def test_lra_style_head_relu_of_mlp_dim():
    model = make(head_activation="relu")  # head_dims null: one hidden layer of mlp_dim
    assert [type(m) for m in model.head] == [nn.Linear, nn.ReLU, nn.Linear]
    assert model.head[0].out_features == 32


def test_paper_style_head_gelu_of_4_dim_with_dropout():
    model = make(head_dims=[64], head_dropout=0.1)
    kinds = [type(m) for m in model.head]
    assert kinds == [nn.Dropout, nn.Linear, nn.GELU, nn.Dropout, nn.Linear]
    assert (model.head[1].in_features, model.head[1].out_features) == (16, 64)


def test_dual_concat_head_of_lra_retrieval():
    """Official LRA dual encoder: [u, v] → mlp_dim → ReLU → mlp_dim/2 → ReLU → classes."""
    model = make(dual=True, pair_features="concat", head_dims=[32, 16], head_activation="relu")
    assert model.head[0].in_features == 2 * 16
    assert [m.out_features for m in model.head if isinstance(m, nn.Linear)] == [32, 16, 5]
    a, b = torch.randint(1, 20, (2, 7)), torch.randint(1, 20, (2, 5))
    assert model(a, None, b, None).shape == (2, 5)


def test_embed_norm_normalises_embeddings_before_the_encoder():
    model = make(embed_norm=True, positions="learned")
    seen = []
    model.encoder.register_forward_pre_hook(lambda m, args: seen.append(args[0]) and None)
    model(torch.randint(1, 20, (2, 6)))
    (x,) = seen
    torch.testing.assert_close(x.mean(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)
    assert isinstance(model.embed_norm, nn.LayerNorm)
    assert make().embed_norm is None
