"""Pure functions: the memory op and softmax attention."""

from .attention import attention
from .memory import memory, memory_step

__all__ = ["attention", "memory", "memory_step"]
