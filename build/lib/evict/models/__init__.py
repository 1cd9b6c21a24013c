"""Config dataclasses, presets and the one LM."""

from . import presets
from .config import MIXERS, ModelConfig, MoEConfig
from .lm import LM

__all__ = ["LM", "MIXERS", "ModelConfig", "MoEConfig", "presets"]
