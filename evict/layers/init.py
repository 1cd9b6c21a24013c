"""One helper for the modules' `reset_parameters`: reset every submodule to its own initialisation."""

from __future__ import annotations

from torch import nn


def reset_children(module: nn.Module) -> None:
    """Call `reset_parameters()` on each child that has one (it owns its subtree); descend into containers that have
    none (nn.Sequential, nn.ModuleList). Parameters registered on `module` itself are the caller's to reset."""
    for child in module.children():
        reset = getattr(child, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            reset_children(child)
