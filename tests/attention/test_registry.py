"""The attention registry (names, options, capabilities) and the Hydra attn configs built through it."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import hydra.utils
import pytest
import torch
from omegaconf import OmegaConf

import attnlab.attention as attention
from attnlab.attention import (
    UnsupportedAttentionError,
    available_backends,
    backend_capabilities,
    backend_options,
    build_attention,
    check_support,
)
from attnlab.attention.common.layer import Capabilities
from attnlab.attention.linear.layer import LinearAttention
from attnlab.attention.performer.layer import PerformerAttention
from attnlab.attention.sliced_relu.layer import SlicedReLUAttention
from attnlab.attention.sliced_relu_bump.layer import SlicedReLUBumpAttention
from attnlab.attention.softmax.layer import SoftmaxAttention

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "attn"
EXPECTED = {
    "softmax": SoftmaxAttention,
    "sliced_relu": SlicedReLUAttention,
    "sliced_relu_bump": SlicedReLUBumpAttention,
    "linear": LinearAttention,
    "performer": PerformerAttention,
}
COMMON = ["rope", "rope_base", "dropout", "causal", "qkv_bias", "qkv_dim", "out_bias", "padded_queries"]


def test_every_backend_is_registered_and_builds():
    assert available_backends() == list(EXPECTED)
    for name, cls in EXPECTED.items():
        layer = build_attention(name, 16, 4, rope=True, dropout=0.1)
        assert type(layer) is cls
        assert layer(torch.randn(2, 5, 16)).shape == (2, 5, 16)


def test_unknown_name_lists_known_backends():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'") as err:
        build_attention("flash", 16, 4)
    for name in EXPECTED:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="known backends"):
        backend_capabilities("nope")


def test_unknown_option_lists_accepted_ones():
    with pytest.raises(ValueError, match="unknown option.*num_features.*'sliced_relu'") as err:
        build_attention("sliced_relu", 16, 4, num_features=8)
    assert "accepted options: " + ", ".join(
        [*COMMON, "score_layout", "projection", "projection_hidden", "eps", "standardise", "dropout_site"]
    ) in str(err.value)


def test_options_are_read_from_constructors():
    assert list(backend_options("softmax")) == COMMON
    assert list(backend_options("linear")) == [*COMMON, "eps", "chunk_size"]
    assert backend_options("performer")["num_features"] == 256
    assert backend_options("sliced_relu")["projection"] == "mlp"


@pytest.mark.parametrize("dim,heads", [(10, 4), (16, 0), (0, 2)])
def test_bad_width_or_head_count(dim, heads):
    with pytest.raises(ValueError, match="dim"):
        build_attention("softmax", dim, heads)


def test_unsupported_causal_names_backend_and_reason():
    class Bidirectional(SoftmaxAttention):
        name = "bidirectional"
        capabilities = Capabilities(reasons={"causal": "every query sees every key"})

    with pytest.raises(UnsupportedAttentionError, match="backend 'bidirectional'.*causal: every query sees"):
        Bidirectional(16, 4, causal=True)
    for name in EXPECTED:  # every registered backend has a causal form
        assert build_attention(name, 16, 4, causal=True).causal


def test_capabilities_and_check_support():
    assert backend_capabilities("linear").recurrent_step and backend_capabilities("linear").causal
    assert (
        backend_capabilities("sliced_relu").causal and backend_capabilities("sliced_relu_bump").recurrent_step
    )
    assert all(backend_capabilities(n).padding_mask for n in EXPECTED)
    assert check_support("linear", causal=True, recurrent_step=True, dtype=torch.bfloat16) == []
    # every built-in backend decodes token by token (softmax with a KV cache: attnlab.attention.decoding)
    assert all(check_support(n, causal=True, recurrent_step=True) == [] for n in EXPECTED)
    assert check_support("softmax", dtype=torch.int64)[0].startswith("dtype:")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_hydra_config_composes_and_instantiates(name):
    path = CONF_DIR / f"{name}.yaml"
    cfg = OmegaConf.load(path)
    assert cfg.name == name and cfg._target_ == "attnlab.attention.build_attention" and cfg._partial_
    options = {k: v for k, v in OmegaConf.to_container(cfg).items() if not k.startswith("_") and k != "name"}
    assert not {"dim", "num_heads", "rope", "dropout"} & set(options)
    accepted = backend_options(name)
    for key, value in options.items():  # config defaults are the code defaults
        assert key in accepted, key
        if isinstance(value, str) and value.startswith("${oc.select:"):  # a preset may choose it:
            value = value.removesuffix("}").rsplit(",", 1)[1]  # its fallback is the default
        assert value == accepted[key], (key, value, accepted[key])
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):  # one comment line above every option
        if line and not line.startswith(("#", " ", "_target_", "_partial_", "name:")):
            assert lines[i - 1].startswith("#"), f"{path.name}: no comment above {line!r}"

    factory = hydra.utils.instantiate(cfg)
    layer = factory(dim=16, num_heads=2, rope=True, dropout=0.1)
    assert type(layer) is EXPECTED[name] and layer.training
    mask = torch.tensor([[True, True, True, False]])
    assert layer(torch.randn(1, 4, 16), key_padding_mask=mask).shape == (1, 4, 16)


def test_attention_package_needs_neither_lightning_nor_hydra():
    src = Path(inspect.getfile(attention)).parent
    for file in src.glob("*.py"):
        text = file.read_text()
        for banned in ("import lightning", "from lightning", "import hydra", "from hydra"):
            assert banned not in text, f"{file.name}: {banned}"
    code = (
        "import sys, attnlab.attention; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'hydra')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


BAD_OPTIONS = [
    # (backends, options, message): each bad value must fail when the layer is built, named
    (["sliced_relu"], {"eps": 0.0}, r"eps must be a finite number in \(0, inf\), got 0\.0"),
    (["sliced_relu"], {"eps": -1e-4}, r"eps must be a finite number in \(0, inf\)"),
    (["sliced_relu"], {"projection": "conv"}, r"projection must be 'mlp' or 'linear', got 'conv'"),
    (["linear", "performer"], {"eps": -1e-6}, r"eps must be a finite number in \(0, inf\), got -1e-06"),
    (["linear", "performer"], {"chunk_size": 0}, r"chunk_size must be an integer >= 1, got 0"),
    (["linear", "performer"], {"chunk_size": 2.5}, r"chunk_size must be an integer >= 1, got 2\.5"),
    (["performer"], {"num_features": 0}, r"num_features must be an integer >= 1, got 0"),
    (["performer"], {"redraw_interval": -5}, r"redraw_interval must be an integer >= 0 or null"),
    (["performer"], {"seed": "abc"}, r"seed must be an integer >= 0 or null, got 'abc'"),
    (list(EXPECTED), {"causal": "false"}, r"causal must be true or false, got 'false'"),
    (list(EXPECTED), {"causal": 1}, r"causal must be true or false, got 1"),
    (list(EXPECTED), {"rope": "yes"}, r"rope must be true or false"),
    (list(EXPECTED), {"qkv_bias": None}, r"qkv_bias must be true or false, got None"),
    (list(EXPECTED), {"dropout": 1.0}, r"dropout must be a finite number in \[0, 1\), got 1\.0"),
    (list(EXPECTED), {"dropout": True}, r"dropout must be a finite number in \[0, 1\), got True"),
    (list(EXPECTED), {"rope_base": 0}, r"rope_base must be a finite number in \(0, inf\), got 0"),
    (list(EXPECTED), {"dim": True, "num_heads": 1}, r"must be positive integers; got dim=True"),
    (list(EXPECTED), {"dim": 16, "num_heads": 2.0}, r"must be positive integers; got num_heads=2\.0"),
]


@pytest.mark.parametrize(
    "name,options,message",
    [(name, options, message) for names, options, message in BAD_OPTIONS for name in names],
    ids=lambda x: x if isinstance(x, str) and not x.startswith(("(", "[", "r")) else None,
)
def test_bad_options_fail_at_build_time_for_every_backend(name, options, message):
    options = {"dim": 16, "num_heads": 4, **options}
    with pytest.raises(ValueError, match=message):
        build_attention(name, **options)
    with pytest.raises(ValueError, match=message):  # the same check when the class is built directly
        EXPECTED[name](**options)
