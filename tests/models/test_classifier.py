import pytest
import torch

from attnlab.models.classifier import SequenceClassifier


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
@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("positions", ["learned", "rope", "none"])
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
    with pytest.raises(ValueError, match="positions='sinusoidal'.*learned, rope, none"):
        make(positions="sinusoidal")
    with pytest.raises(ValueError, match="pooling='max'.*mean, cls"):
        make(pooling="max")
