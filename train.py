"""Train one attention backend on one task: ``python train.py task=listops attn=sliced_relu``.

See README.md for the config groups (task, attn, trainer, logger, experiment) and overrides.
"""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from attnlab.pipeline import train  # imported late so `--help` and config errors stay fast

    summary = train(cfg)
    return summary["val_acc"]  # the value a Hydra sweeper would optimise


if __name__ == "__main__":
    main()
