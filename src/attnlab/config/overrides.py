"""Command-line overrides checked before Hydra composes the config.

Hydra answers a misspelt backend option (``attn.projeciton=linear``) with "Key 'projeciton' is not in
struct ... use +attn.projeciton", and with the ``+`` the list of accepted options arrives wrapped in
"Error in call to target". Both happen before attnlab's code runs, so `train.py` asks this module
first: an ``attn.<option>`` the chosen backend does not take gets one line naming the key and the
accepted options. Anything it cannot judge (a backend it does not know, an ``experiment=`` preset
that may choose the backend) is left to Hydra.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from attnlab.config.validation import MODEL_SUPPLIED

_ATTN_OPTION = re.compile(r"^[+~]{0,2}attn\.([A-Za-z_][\w]*)(?:[.=]|$)")
#: keys an attn config has that are not layer options
_CONFIG_KEYS = {"_target_", "_partial_", "name", "module"}


def chosen_backends(args: list[str], conf_dir: Path) -> list[str] | None:
    """The backends the command line selects (``attn=a,b`` in a sweep), or None when a preset may."""
    chosen = None
    for arg in args:
        if arg.startswith("attn="):
            chosen = [name.strip() for name in arg.removeprefix("attn=").split(",") if name.strip()]
    if chosen is not None:
        return chosen
    if any(arg.startswith("experiment=") for arg in args):
        return None  # a preset may choose the backend in its defaults
    for entry in OmegaConf.load(conf_dir / "train.yaml").defaults:
        if isinstance(entry, DictConfig) and "attn" in entry:
            return [entry["attn"]]
    return None


def check_attention_options(args: list[str], conf_dir: Path) -> str | None:
    """The problem with an ``attn.<option>=`` override, in one line, or None."""
    options = [m.group(1) for m in map(_ATTN_OPTION.match, args) if m]
    if not options:
        return None
    backends = chosen_backends(args, conf_dir)
    if not backends:
        return None
    from attnlab.attention.registry import available_backends, backend_options

    for backend in backends:
        if backend not in available_backends():
            return None  # a user backend (registered by its config's module) or a typo Hydra will name
        config = conf_dir / "attn" / f"{backend}.yaml"
        keys = set(OmegaConf.load(config)) if config.is_file() else set()
        accepted = set(backend_options(backend)) | keys
        for option in options:
            if option in MODEL_SUPPLIED:
                return (
                    f"attn.{option}: set by the model, not by the attention config; "
                    f"use {MODEL_SUPPLIED[option]}"
                )
            if option not in accepted | _CONFIG_KEYS:
                return (
                    f"attn.{option}: no such option for attention backend {backend!r}; accepted options: "
                    f"{', '.join(sorted(accepted - _CONFIG_KEYS - set(MODEL_SUPPLIED)))}"
                )
    return None
