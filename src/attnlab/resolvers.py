"""The config resolvers attnlab's YAML files use, registered when ``attnlab`` is imported.

- ``${attnlab_resume_dir:<ckpt_path>,<default>}``: a resumed run continues in its checkpoint's run dir
  (`attnlab.resume.resume_run_dir`);
- ``${attnlab_accumulate:<global batch>,<micro-batch>,<devices>,<nodes>}``: gradient accumulation that
  keeps a stated global batch over any number of devices (`attnlab.batching.accumulation`);
- ``${attnlab_lra_padded_queries:${attn.name}}``: LRA's black-pixel rule for the chosen backend.

Only light imports: ``train.py`` registers them before Hydra composes the config.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from attnlab.batching import accumulation
from attnlab.resume import resume_run_dir


def lra_padded_queries(backend: str) -> str:
    """LRA's rule for padded queries where the backend has it (softmax: ``lra``), else ``attend``."""
    return "lra" if backend == "softmax" else "attend"


RESOLVERS = {
    "attnlab_resume_dir": resume_run_dir,
    "attnlab_accumulate": accumulation,
    "attnlab_lra_padded_queries": lra_padded_queries,
}


def register_resolvers() -> None:
    """Register every resolver once (idempotent)."""
    for name, function in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)
