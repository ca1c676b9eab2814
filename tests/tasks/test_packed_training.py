"""``task.data.packing=true`` trains as the padded run does: the same examples in the same steps, the
same outputs per example, so (dropout off) the same losses and accuracy up to float rounding."""

from __future__ import annotations

import pytest

from attnlab.errors import ConfigError
from attnlab.pipeline import train
from tiny_runs import TINY_LISTOPS

RUN = [
    *TINY_LISTOPS,
    "logger=none",
    "trainer.max_steps=12",
    "task.val_check_interval=6",
    "task.data.bucket_by_length=false",  # mixed lengths in each batch: padding that packing removes
    "task.model.dropout=0.0",  # dropout's masks follow the tensors' shapes, which packing changes
    "task.model.attn_dropout=0.0",
]


@pytest.mark.parametrize("attn", ["sliced_relu", "softmax"])
def test_packed_run_ends_where_the_padded_run_ends(train_config, tmp_path, attn):
    padded = train(train_config(*RUN, f"attn={attn}", f"paths.run_dir={tmp_path / 'padded'}"))
    packed = train(
        train_config(*RUN, f"attn={attn}", "task.data.packing=true", f"paths.run_dir={tmp_path / 'packed'}")
    )
    assert packed["test_acc"] == padded["test_acc"]
    assert packed["test_loss"] == pytest.approx(padded["test_loss"], rel=1e-4)
    assert packed["val_acc"] == padded["val_acc"]
    assert 0.5 < packed["packing_fill"] <= 1.0
    assert "packing_fill" not in padded


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("task.model.pooling=cls", "pooling='cls' cannot read a packed batch"),
        ("attn.score_layout=authors", "score_layout='authors' cannot read a packed batch"),
    ],
)
def test_a_model_that_cannot_read_packed_batches_is_refused_before_training(
    train_config, tmp_path, override, why
):
    cfg = train_config(*RUN, "attn=sliced_relu", override, "task.data.packing=true")
    with pytest.raises(ConfigError, match=f"task.data.packing=true: {why}.*set task.data.packing=false"):
        train(cfg)
    assert not list(tmp_path.rglob("*.ckpt"))
