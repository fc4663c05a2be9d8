"""vmapens: train many same-architecture PyTorch networks at once."""

__version__ = "0.1.0"
