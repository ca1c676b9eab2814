"""The start-up GPU check: a device the installed torch build (or Triton) cannot run
on stops ``trainer=gpu|ddp|ddp_slurm`` before any work, with one line naming the device, the build and
the fix. No GPU here: the device is faked by monkeypatching ``torch.cuda``; Triton's half compiles
its probe kernel for the faked capability for real (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from attnlab import pipeline
from attnlab.attention.common import gpu_check
from attnlab.attention.common.gpu_check import GPUUnsupportedError, check_gpus, runs_on
from attnlab.errors import user_error

PINNED = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.10 CUDA 12.8
NO_VOLTA = PINNED[1:]  # torch 2.11+ CUDA 12.8 / 13.0 builds


def fake_devices(monkeypatch, devices, archs=PINNED):
    """``devices``: (name, (major, minor)) per visible GPU; ``archs``: the build's kernel list."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(devices))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: devices[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: devices[i][1])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(archs))
    monkeypatch.setattr(torch.version, "cuda", "12.8")


@pytest.mark.parametrize(
    ("archs", "capability", "runs"),
    [
        (PINNED, (7, 0), True),  # V100
        (PINNED, (9, 0), True),  # H100 / H200
        (PINNED, (8, 9), True),  # L40: sm_86 cubins run on 8.9
        (PINNED, (10, 3), True),
        (PINNED, (6, 0), False),  # P100
        (NO_VOLTA, (7, 0), False),  # V100 on torch 2.11+
        (["sm_86"], (8, 0), False),  # a cubin never runs on a lower minor
        (["sm_90a"], (9, 0), True),
        (["sm_100a"], (10, 3), False),  # arch-specific cubins run on exactly their capability
        (["sm_80", "compute_80"], (12, 0), True),  # PTX is JIT-compiled upwards
        (["compute_90"], (8, 6), False),
    ],
)
def test_compatibility_rule(archs, capability, runs):
    assert runs_on(archs, capability) is runs


@pytest.mark.parametrize("trainer", ["gpu", "ddp", "ddp_slurm"])
def test_unsupported_device_stops_before_any_work(trainer, train_config, monkeypatch):
    cfg = train_config(f"trainer={trainer}")
    fake_devices(monkeypatch, [("Tesla V100-SXM2-32GB", (7, 0))], NO_VOLTA)
    monkeypatch.setattr(pipeline, "check_slurm_layout", lambda cfg: None)  # not inside a SLURM job here

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the GPU check")

    monkeypatch.setattr(pipeline, "instantiate", no_work)
    with pytest.raises(GPUUnsupportedError) as caught:
        pipeline.train(cfg)
    message = str(user_error(caught.value))  # what train.py prints after `error: `
    assert "\n" not in message
    for part in ("cuda:0 Tesla V100-SXM2-32GB", "compute capability 7.0", "sm_70", "torch 2.10", "CUDA 12.8"):
        assert part in message, part
    assert "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120" in message  # the build's list
    assert "install a torch build" in message and "trainer=cpu" in message  # the fix


def test_second_device_is_checked_too(monkeypatch):
    fake_devices(monkeypatch, [("NVIDIA H200", (9, 0)), ("Tesla P100-PCIE-16GB", (6, 0))])
    with pytest.raises(
        GPUUnsupportedError, match=r"cuda:1 Tesla P100-PCIE-16GB \(compute capability 6.0, sm_60\)"
    ):
        check_gpus({"accelerator": "gpu"})


@pytest.mark.parametrize("capability", [(7, 0), (8, 0), (9, 0), (12, 0)])
def test_supported_devices_pass(capability, monkeypatch):
    """V100 to Blackwell on the pinned build: the torch list covers them and Triton builds for them."""
    fake_devices(monkeypatch, [("GPU", capability)] * 2)
    check_gpus({"accelerator": "gpu"})
    check_gpus({"accelerator": "auto"})


def test_triton_that_cannot_build_for_the_device_stops(monkeypatch):
    """A device torch can run (its PTX JIT-compiles upwards) but Triton's ptxas does not know."""
    pytest.importorskip("triton")
    fake_devices(monkeypatch, [("Future GPU", (13, 0))], [*PINNED, "compute_120"])
    with pytest.raises(GPUUnsupportedError) as caught:
        check_gpus({"accelerator": "cuda"})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("cuda:0 Future GPU (compute capability 13.0, sm_130): Triton ")
    assert "cannot build kernels for sm_130: " in message  # and ptxas's own line after it


def test_cpu_trainers_are_not_checked(monkeypatch):
    fake_devices(monkeypatch, [("Tesla P100-PCIE-16GB", (6, 0))])
    check_gpus({"accelerator": "cpu"})
    fake_devices(monkeypatch, [])
    check_gpus({"accelerator": "auto"})  # auto without CUDA: Lightning picks the CPU


def test_gpu_trainer_without_cuda_says_so(monkeypatch):
    fake_devices(monkeypatch, [])
    with pytest.raises(
        GPUUnsupportedError, match=r"trainer.accelerator='gpu' asks for a GPU but torch .* sees no"
    ):
        check_gpus({"accelerator": "gpu"})


def test_build_list_read_without_a_driver(monkeypatch):
    """Without a driver ``get_arch_list()`` is empty: the build's own flags are read instead."""
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: [])
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: "sm_70 sm_80 sm_90", raising=False)
    assert gpu_check.build_archs() == ["sm_70", "sm_80", "sm_90"]
