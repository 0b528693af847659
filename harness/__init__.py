"""harness: run PyTorch DDP experiments so that they can be replayed and judged bit for bit."""

__version__ = "0.1.0"
