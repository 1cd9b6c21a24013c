"""Config dataclasses, presets and the one LM."""

from . import presets
from .config import MIXERS, ModelConfig, MoEConfig
from .compile_blocks import compile_blocks
from .lm import LM

__all__ = ["LM", "compile_blocks", "MIXERS", "ModelConfig", "MoEConfig", "presets"]
