"""The tiny ViT: timm's VisionTransformer with registry attention in every block, any backend by name."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from timm.models.vision_transformer import Block, VisionTransformer

from attnlab.attention import AttentionLayer, available_backends
from attnlab.models.vit import RegistryBlock, num_tokens, tiny_vit

SMALL = dict(stem_channels=[8, 16], dim=32, depth=2, num_heads=4, mlp_dim=64, drop_path=0.0)
PAPER_PARAMS = 4.54e6  # the sliced ReLU paper's tiny ViT on CIFAR-10


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("attn", available_backends())
def test_every_backend_trains_inside_timms_blocks(attn):
    torch.manual_seed(0)
    model = tiny_vit(attn, num_classes=10, **SMALL)
    assert isinstance(model, VisionTransformer)
    for block in model.blocks:
        assert isinstance(block, Block) and isinstance(block.attn, AttentionLayer)
        assert block.attn.name == attn
    images = torch.randn(4, 3, 32, 32)
    logits = model(images)
    assert logits.shape == (4, 10) and torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    attn_grads = [p.grad for p in model.blocks[0].attn.parameters() if p.requires_grad]
    assert attn_grads and all(g is not None and torch.isfinite(g).all() for g in attn_grads)
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0  # the registry layer is on the path


@pytest.mark.parametrize("attn", available_backends())
def test_permuting_the_batch_permutes_the_outputs(attn):
    torch.manual_seed(1)
    model = tiny_vit(attn, num_classes=10, **SMALL).eval()  # eval: BatchNorm uses running statistics
    images = torch.randn(6, 3, 32, 32)
    order = torch.randperm(6)
    with torch.no_grad():
        torch.testing.assert_close(model(images)[order], model(images[order]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_class_token_and_mean_pooling(pooling):
    torch.manual_seed(0)
    model = tiny_vit("sliced_relu", num_classes=5, pooling=pooling, **SMALL)
    assert (model.cls_token is not None) == (pooling == "cls")
    assert model.global_pool == {"cls": "token", "mean": "avg"}[pooling]
    # learned positions cover the patches (and the class token)
    assert model.pos_embed.shape[1] == 64 + (pooling == "cls")
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 5) and torch.isfinite(out).all()


def test_the_conv_stem_sets_the_token_count():
    """Stride 4 on 32 px gives 64 tokens; the same model on 64 px Tiny ImageNet images gives 256."""
    assert num_tokens(tiny_vit("softmax", 10, img_size=32, **SMALL)) == 64
    model = tiny_vit("softmax", 200, img_size=64, **SMALL)
    assert num_tokens(model) == 256 and model(torch.randn(2, 3, 64, 64)).shape == (2, 200)
    digits = tiny_vit("softmax", 10, img_size=8, in_chans=1, patch_size=2, **{**SMALL, "stem_channels": [8]})
    assert num_tokens(digits) == 16 and digits(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_paper_preset_has_the_papers_parameter_count(train_config):
    """experiment=vit/cifar10: 4.54 M ± 1.5 % for every backend, sliced ReLU with the linear slicing
    projection (docs/vision.md states each count)."""
    counts = {}
    for attn, extra in [
        ("softmax", []),
        ("sliced_relu", []),
        ("sliced_relu", ["attn.projection=linear"]),
        ("sliced_relu_bump", []),
    ]:
        cfg = train_config("experiment=vit/cifar10", f"attn={attn}", *extra)
        model = instantiate(cfg.task.model, attention=instantiate(cfg.attn), num_classes=10, img_size=32)
        key = f"{attn} {' '.join(extra)}".strip()
        counts[key] = params(model)
        assert abs(counts[key] / PAPER_PARAMS - 1) <= 0.015, (key, counts[key])
    assert counts["softmax"] == 4_507_530 and counts["sliced_relu"] == 4_514_726
    assert counts["sliced_relu attn.projection=linear"] == 4_514_726
    # outside the preset the slicing MLP keeps the registry's H·D -> H·D -> H: +dim^2 + ... per block
    cfg = train_config("task=cifar10_vit", "attn=sliced_relu")
    mlp = instantiate(cfg.task.model, attention=instantiate(cfg.attn), num_classes=10, img_size=32)
    assert params(mlp) == 4_975_270


def test_block_options_reach_timm_and_the_attention():
    model = tiny_vit("softmax", 10, layer_scale=1e-5, attn_dropout=0.2, **{**SMALL, "drop_path": 0.3})
    block = model.blocks[-1]
    assert isinstance(block, RegistryBlock) and block.attn.dropout == 0.2
    assert torch.allclose(block.ls1.gamma, torch.full((32,), 1e-5))  # timm LayerScale
    assert block.drop_path1.drop_prob == pytest.approx(0.3)  # timm DropPath, linear rule: last block at max
    assert model.blocks[0].mlp.fc1.out_features == 64


def test_bad_model_options_name_the_value():
    with pytest.raises(ValueError, match="patch_size=3 must be a power of two"):
        tiny_vit("softmax", 10, patch_size=3, **SMALL)
    with pytest.raises(ValueError, match="pooling='max' is not supported; choose one of cls, mean"):
        tiny_vit("softmax", 10, pooling="max", **SMALL)
    with pytest.raises(
        ValueError, match=r"stem_channels=\[8\] has 1 conv\(s\); patch_size=4 needs at least 2"
    ):
        tiny_vit("softmax", 10, **{**SMALL, "stem_channels": [8]})
    with pytest.raises(ValueError, match="img_size=30 is not divisible by patch_size=4"):
        tiny_vit("softmax", 10, img_size=30, **SMALL)
    with pytest.raises(ValueError, match="unknown attention backend 'sofmax'"):
        tiny_vit("sofmax", 10, **SMALL)
    block = tiny_vit("softmax", 10, **SMALL).blocks[0]
    with pytest.raises(ValueError, match="takes no attn_mask"):
        block(torch.randn(1, 4, 32), attn_mask=torch.ones(4, 4, dtype=torch.bool))
