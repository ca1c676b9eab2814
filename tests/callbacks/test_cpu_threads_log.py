"""The run's thread lines say what happens: no governor promised when the run turns it off, and
deterministic mode's fixed count said once, not once per stage."""

from __future__ import annotations

import logging

import torch
from omegaconf import OmegaConf

from attnlab import pipeline, threads
from attnlab.callbacks.threads import CpuThreads

ADAPTIVE = threads.ThreadSettings(
    cap=2, wait="GOMP_SPINCOUNT=10000", chosen_by={"threads": "attnlab", "wait": "attnlab"}
)


def _cfg(cpu_threads, deterministic=False, accelerator="cpu"):
    return OmegaConf.create(
        {
            "callbacks": {"cpu_threads": cpu_threads},
            "trainer": {"deterministic": deterministic, "accelerator": accelerator},
        }
    )


def test_the_first_line_promises_the_governor_only_when_it_runs(monkeypatch, caplog):
    monkeypatch.setattr(pipeline, "thread_settings", lambda: ADAPTIVE)
    said = {}
    for name, cfg in {
        "on": _cfg({"_target_": "attnlab.callbacks.threads.CpuThreads"}),
        "null": _cfg(None),
        "deterministic": _cfg({"_target_": "x"}, deterministic=True),
        "gpu": _cfg({"_target_": "x"}, accelerator="gpu"),
        "auto": _cfg({"_target_": "x"}, accelerator="auto"),  # no GPU in the tests: the CPU
    }.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="attnlab.pipeline"):
            pipeline._log_cpu_threads(cfg)
        said[name] = caplog.text
    assert "following the CPUs other processes leave free" in said["on"]
    assert ("following" in said["auto"]) == (not torch.cuda.is_available())
    for name in ("null", "deterministic", "gpu"):
        assert "CPU threads: 2 threads (attnlab)" in said[name] and "following" not in said[name], name


class _Trainer:
    class strategy:  # noqa: N801 - the attribute Lightning's trainer has
        root_device = torch.device("cpu")


def test_deterministic_mode_says_its_fixed_count_once(monkeypatch, caplog):
    monkeypatch.setattr("attnlab.callbacks.threads.applied", lambda: ADAPTIVE)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    callback = CpuThreads()
    with caplog.at_level(logging.INFO, logger="attnlab.callbacks.threads"):
        callback.setup(_Trainer(), None, "fit")
        callback.setup(_Trainer(), None, "test")
    assert caplog.text.count("fixed at") == 1 and callback.governor is None
