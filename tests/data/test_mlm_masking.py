"""The MLM datamodule's masking as ``task=mlm`` configures it: the batches it produces, not the masking
function at its defaults."""

from __future__ import annotations

import torch
from hydra.utils import instantiate

TINY = [
    "task=mlm",
    "task.data.source.tokenizer.vocab_size=512",
    "task.data.seq_len=64",
    "task.data.batch_size=32",
    "task.data.num_workers=0",
]


def _shares(inputs, targets, originals, mask_id):
    predicted = targets != -100
    n = int(predicted.sum())
    as_mask = int((inputs[predicted] == mask_id).sum()) / n
    kept = int((inputs[predicted] == originals[predicted]).sum()) / n
    return n, as_mask, kept, 1 - as_mask - kept


def test_training_and_evaluation_batches_are_masked_as_configured(train_config):
    cfg = train_config(*TINY)
    rate, mask_prob, random_prob = cfg.task.data.mask_rate, cfg.task.data.mask_prob, cfg.task.data.random_prob
    assert (rate, mask_prob, random_prob) == (0.2, 0.8, 0.1)  # the paper's and BERT's recipe
    datamodule = instantiate(cfg.task.data)
    datamodule.prepare_data()
    datamodule.setup()
    tokenizer, special = datamodule.tokenizer, torch.tensor(datamodule.tokenizer.special_ids)

    originals, inputs, targets = [], [], []
    for counter, batch in zip(range(12), datamodule.train_dataloader(), strict=False):
        assert "labels" not in batch  # masked on the device, after the transfer
        masked = datamodule.mask_train_batch(batch, counter)
        originals.append(batch["input_ids"])
        inputs.append(masked["input_ids"])
        targets.append(masked["labels"])
    originals, inputs, targets = torch.cat(originals), torch.cat(inputs), torch.cat(targets)
    ordinary = ~torch.isin(originals, special)
    assert not (targets[~ordinary] != -100).any(), "special tokens are never predicted"
    assert abs(int((targets != -100).sum()) / int(ordinary.sum()) - rate) < 0.02
    n, as_mask, kept, replaced = _shares(inputs, targets, originals, tokenizer.mask_id)
    assert n > 3000
    assert abs(as_mask - mask_prob) < 0.03 and abs(kept - (1 - mask_prob - random_prob)) < 0.03
    assert abs(replaced - random_prob) < 0.03
    assert not torch.isin(
        inputs[targets != -100][inputs[targets != -100] != tokenizer.mask_id], special
    ).any()

    val = [datamodule.datasets["val"][i] for i in range(len(datamodule.datasets["val"]))]
    val_inputs = torch.stack([v["input_ids"] for v in val])
    val_targets = torch.stack([v["labels"] for v in val])
    originals = torch.where(val_targets != -100, val_targets, val_inputs)
    n, as_mask, kept, replaced = _shares(val_inputs, val_targets, originals, tokenizer.mask_id)
    assert n > 200 and 0.7 < as_mask < 0.9 and kept < 0.2 and replaced < 0.2
