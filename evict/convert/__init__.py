"""Converters between evict's LM and the ecosystem's formats.

    from_hf_gpt2(hf_model) -> LM        a transformers GPT2LMHeadModel as an evict LM (evict.convert.gpt2)
    to_fla(lm, out) -> Path             an HF folder (config.json + model.safetensors) for fla's KDA / Gated DeltaNet
                                        models (evict.convert.fla); docs/convert.md lists what maps and what does not
The CLI forms are `evict convert gpt2 | fla | hf` (evict.commands.convert).
"""

from .fla import fla_config, fla_state_dict, to_fla
from .gpt2 import from_hf_gpt2

__all__ = ["fla_config", "fla_state_dict", "from_hf_gpt2", "to_fla"]
