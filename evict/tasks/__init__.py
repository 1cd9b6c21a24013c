"""Tasks: each yields deterministic (inputs, targets) batches; the training loop knows nothing else about them."""

from .base import Task
from .text import TextTask

__all__ = ["Task", "TextTask"]
