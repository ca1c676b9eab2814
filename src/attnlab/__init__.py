"""attnlab: train and benchmark attention mechanisms with PyTorch Lightning + Hydra."""

from attnlab.config.resolvers import register_resolvers

__version__ = "0.1.0"

register_resolvers()  # the configs' ${attnlab_...:...} must resolve wherever they are composed
