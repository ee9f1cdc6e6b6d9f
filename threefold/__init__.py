"""threefold: 3D-parallel (data x tensor x pipeline) training of transformer language models."""

__version__ = "0.1.0"
