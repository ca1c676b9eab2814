"""attnlab: train and benchmark attention mechanisms with PyTorch Lightning + Hydra."""

from attnlab.resume import register_resolvers

__version__ = "0.1.0"

register_resolvers()  # the configs' ${attnlab_resume_dir:...} must resolve wherever they are composed

from attnlab.batching import register_resolvers as _register_batching  # noqa: E402

_register_batching()  # ${attnlab_accumulate:...}: a global batch kept over any number of devices
