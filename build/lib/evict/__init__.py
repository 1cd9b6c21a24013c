"""evict: attention is an associative memory; a fixed-size memory must evict."""

from .models import LM, ModelConfig, presets

__version__ = "0.1.0"
__all__ = ["LM", "ModelConfig", "presets"]
