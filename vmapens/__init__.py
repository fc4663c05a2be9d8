"""vmapens: train many same-architecture PyTorch networks at once."""

from .ensemble import Ensemble, per_member

__all__ = ["Ensemble", "per_member"]
__version__ = "0.1.0"
