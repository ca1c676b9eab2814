"""`experiment=lm/gpt2_small` is nanoGPT's GPT-2 small: 124 M parameters (tied head, no biases) and its
initialisation (normal(0, 0.02), residual projections at 0.02/√(2·layers)); the LM's options in small."""

from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from attnlab.models.causal_lm import CausalLM


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied matrix once


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from conftest import compose_train_config

    cfg = compose_train_config(["experiment=lm/gpt2_small", "attn=softmax"], tmp_path_factory.mktemp("gpt2"))
    torch.manual_seed(0)
    return instantiate(
        cfg.task.model, vocab_size=cfg.task.data.source.tokenizer.vocab_size, attention=instantiate(cfg.attn)
    )


def test_the_preset_counts_gpt2_smalls_124m(gpt2):
    count = _params(gpt2)
    assert count == 124_337_664  # 12 × 7,079,424 blocks + 50,257 × 768 tokens + 1,024 × 768 positions + 768
    assert abs(count / 124e6 - 1) <= 0.005
    assert gpt2.head.weight is gpt2.embed.weight and gpt2.head.bias is None
    assert not [name for name, _ in gpt2.named_parameters() if name.endswith("bias")]


def test_the_preset_has_nanogpts_initialisation(gpt2):
    residual = 0.02 / math.sqrt(2 * 12)
    for i, block in enumerate(gpt2.encoder.blocks):
        for weight, std in (
            (block.attn.qkv.weight, 0.02),
            (block.mlp[0].weight, 0.02),
            (block.attn.out_proj.weight, residual),
            (block.mlp[-1].weight, residual),
        ):
            assert abs(weight.std().item() / std - 1) < 0.01, (i, tuple(weight.shape))
            assert abs(weight.mean().item()) < 0.01 * std
        assert torch.equal(block.norm1.weight, torch.ones(768))
    assert abs(gpt2.embed.weight.std().item() / 0.02 - 1) < 0.01
    assert abs(gpt2.pos_embed.std().item() / 0.02 - 1) < 0.01


def test_the_defaults_stay_untied_with_biases_and_torchs_init():
    torch.manual_seed(0)
    model = CausalLM(100, "softmax", dim=32, depth=2, num_heads=2)
    assert model.head.weight is not model.embed.weight and model.head.bias is not None
    assert model.encoder.blocks[0].attn.qkv.bias is not None and model.encoder.norm.bias is not None
    assert abs(model.embed.weight.std().item() - 1) < 0.1  # torch's Embedding: normal(0, 1)


def test_a_tied_model_trains_its_one_matrix_from_both_ends():
    torch.manual_seed(0)
    model = CausalLM(
        50, "sliced_relu", dim=16, depth=2, num_heads=2, tie_embeddings=True, bias=False, init="gpt2"
    )
    assert (
        model.encoder.blocks[0].attn.qkv.bias is None and model.encoder.blocks[0].attn.out_proj.bias is None
    )
    tokens = torch.randint(0, 50, (2, 9))
    model(tokens).logsumexp(-1).sum().backward()
    # only the head reads the rows of tokens that never appear in the input
    unseen = sorted(set(range(50)) - set(tokens.flatten().tolist()))
    assert model.embed.weight.grad[unseen].abs().sum() > 0
    untied = CausalLM(50, "sliced_relu", dim=16, depth=2, num_heads=2)
    assert _params(untied) - _params(model) > 50 * 16  # the head's matrix and the biases


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"init='xavier' is not supported; choose one of torch, gpt2"):
        CausalLM(10, "softmax", dim=8, depth=1, num_heads=2, init="xavier")
    with pytest.raises(ValueError, match=r"tie_embeddings must be true or false, got 'yes'"):
        CausalLM(10, "softmax", dim=8, depth=1, num_heads=2, tie_embeddings="yes")
