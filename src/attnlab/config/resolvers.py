"""The config resolvers attnlab's YAML files use, registered when ``attnlab`` is imported.

- ``${attnlab_resume_dir:<ckpt_path>,<default>}``: a resumed run continues in its checkpoint's run dir
  (`attnlab.run.resume.resume_run_dir`);
- ``${attnlab_accumulate:<global batch>,<micro-batch>,<devices>,<nodes>}``: gradient accumulation that
  keeps a stated global batch over any number of devices (`attnlab.config.grad_accumulation.accumulation`);
- ``${attnlab_lra_padded_queries:${attn.name},${lra_code}}``: LRA's black-pixel rule for the chosen
  backend and the LRA code to follow (`lra_padded_queries`);
- ``${attnlab_scaled:<value>,<length>,<reference length>}``: a count that grows (or, with the two
  lengths swapped, shrinks) in proportion to the sequence length, e.g. MQAR's key-value pairs and
  batch size in the length sweep (`scaled`).

Only light imports: ``train.py`` registers them before Hydra composes the config.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from attnlab.config.grad_accumulation import accumulation
from attnlab.errors import ConfigError
from attnlab.run.resume import resume_run_dir

#: ``lra_code`` of the LRA presets -> softmax's padded-query rule (`attnlab.attention.common.padding`)
LRA_CODES = {"leaderboard": "lra2020", "head": "lra"}


def lra_padded_queries(backend: str, code: str = "leaderboard") -> str:
    """LRA's rule for padded queries where the backend has it, else ``attend``. Softmax follows the LRA
    code named by ``code``: ``leaderboard`` (the code behind the LRA paper's numbers, before 2022-04: a
    black pixel's row is the sum of V, ``lra2020``) or ``head`` (today's: the mean, ``lra``)."""
    if code not in LRA_CODES:
        raise ConfigError(f"lra_code={code!r}: expected one of {', '.join(LRA_CODES)}")
    return LRA_CODES[code] if backend == "softmax" else "attend"


def scaled(value: int, length: int, reference: int) -> int:
    """``value × length / reference`` rounded down, at least 1: a count stated at a reference length and
    kept in proportion at another (attnlab's MQAR length sweep scales the pairs with the length, as
    Zoology's does, and keeps the tokens per batch, so the batch shrinks as the length grows). The
    floor of 1 means the proportion no longer holds past ``value × length < reference`` (a batch of
    64 at 64 tokens stays 1 sequence from 4,096 tokens on)."""
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in (value, length, reference)):
        raise ConfigError(f"attnlab_scaled:{value!r},{length!r},{reference!r}: expected three integers >= 1")
    return max(1, value * length // reference)


RESOLVERS = {
    "attnlab_resume_dir": resume_run_dir,
    "attnlab_accumulate": accumulation,
    "attnlab_lra_padded_queries": lra_padded_queries,
    "attnlab_scaled": scaled,
}


def register_resolvers() -> None:
    """Register every resolver once (idempotent)."""
    for name, function in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)
