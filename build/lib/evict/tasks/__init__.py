"""Tasks: each yields deterministic (inputs, targets) batches; the training loop knows nothing else about them."""

from .base import Task
from .mqar import MQARConfig, MQARTask
from .text import TextTask

__all__ = ["MQARConfig", "MQARTask", "Task", "TextTask"]
