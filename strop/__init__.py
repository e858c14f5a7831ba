"""strop: train a specialist coding-agent model with asynchronous reinforcement learning."""

__version__ = "0.1.0"
