"""attnlab: train and benchmark attention mechanisms with PyTorch Lightning + Hydra."""

__version__ = "0.1.0"
