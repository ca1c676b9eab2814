"""A checkpoint that cannot be written (a full disk) is one line naming the file, not a traceback."""

from __future__ import annotations

import errno

import pytest
import torch

from attnlab.callbacks.checkpoint import AtomicCheckpointIO
from attnlab.errors import user_error


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file"),
    ],
)
def test_a_full_disk_is_one_line_naming_the_checkpoint(tmp_path, monkeypatch, failure):
    last = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, last)

    def full(obj, handle, *args, **kwargs):
        handle.write(b"PK\x03\x04 part")
        raise failure

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as caught:
        AtomicCheckpointIO().save_checkpoint({"global_step": 4}, last)
    monkeypatch.undo()
    message = str(user_error(caught.value))
    assert message.startswith(f"{last}: ") and "\n" not in message
    assert "last.ckpt was not written, the previous one is intact" in message
    assert torch.load(last, weights_only=True)["global_step"] == 3


def test_a_programming_error_in_a_checkpoint_stays_a_traceback(tmp_path, monkeypatch):
    def broken(obj, handle, *args, **kwargs):
        raise RuntimeError("cannot pickle 'generator' object")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError) as caught:
        AtomicCheckpointIO().save_checkpoint({"global_step": 4}, tmp_path / "last.ckpt")
    assert user_error(caught.value) is None
