"""The depth lens: what a trained small K3-style model does over depth, read out of a real forward pass.

    lens(attn_res_model, plain_model, tokens) -> {"attn_res": {...}, "plain": {...}}
    load() -> the committed lens of `dev/depth_lens.py` (evict/explore/data/depth_lens.json), checked

AttnRes model: the final read's softmax weights over its depth sources (the embedding, then each completed block's
sum) per token, and the RMS of every sublayer input (each a read over the sources so far). Plain model (the same
config with attn_res=False): the residual sum gives every source weight 1 (equal), and the RMS of h after each
layer grows with depth. RMS = sqrt(mean over the width of h²), averaged over the tokens.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import cast

import torch

from evict.jsonfile import read_json_object
from evict.ops.attn_res import attn_res_weights

DATA = "data/depth_lens.json"


def _rms(h: torch.Tensor) -> float:
    return float(h.double().pow(2).mean(-1).sqrt().mean())


@torch.no_grad()
def _attn_res_side(model, tokens: torch.Tensor) -> dict:
    reads: list[tuple[str, torch.Tensor, float]] = []  # (name, weights [S, T], rms of the read)

    def hook(name):
        def fn(mod, inputs, out):
            w = attn_res_weights(inputs[0], mod.query, mod.norm.weight, mod.norm.eps)  # [S, 1, T]
            reads.append((name, w[:, 0], _rms(out)))
        return fn

    handles = [blk.read_mixer.register_forward_hook(hook(f"layer {i + 1} mixer"))
               for i, blk in enumerate(model.blocks) if blk.read_mixer is not None]
    handles += [blk.read_ffn.register_forward_hook(hook(f"layer {i + 1} ffn")) for i, blk in enumerate(model.blocks)]
    handles.append(model.final_read.register_forward_hook(hook("final")))
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    final = reads[-1][1]  # [S, T]
    order = sorted(reads[:-1], key=lambda r: (int(r[0].split()[1]), r[0].endswith("ffn")))
    block = model.cfg.attn_res_block
    n_blocks = -(-model.cfg.n_layers // block)
    spans = [(b * block + 1, min((b + 1) * block, model.cfg.n_layers)) for b in range(n_blocks)]
    return {"sources": ["embedding"] + [f"layer {a}" if a == z else f"layers {a}–{z}" for a, z in spans][: final.shape[0] - 1],
            "final_weights": final.T.tolist(),  # [T, S]
            "final_mean": final.mean(-1).tolist(),  # [S]
            "read_rms": [{"read": name, "rms": rms} for name, _, rms in order] + [{"read": "final", "rms": reads[-1][2]}]}


@torch.no_grad()
def _plain_side(model, tokens: torch.Tensor) -> dict:
    outs: list[torch.Tensor] = []
    handles = [model.embed.register_forward_hook(lambda m, i, o: outs.append(o))]
    for blk in model.blocks:
        handles += [blk.mixer.register_forward_hook(lambda m, i, o: outs.append(o)),
                    blk.ffn.register_forward_hook(lambda m, i, o: outs.append(o))]
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    h, rms = outs[0], []
    for i in range(len(model.blocks)):
        h = h + outs[1 + 2 * i] + outs[2 + 2 * i]  # the residual stream after layer i + 1
        rms.append({"layer": i + 1, "rms": _rms(h)})
    return {"embedding_rms": _rms(outs[0]), "layer_rms": rms}


def lens(attn_res_model, plain_model, tokens: torch.Tensor) -> dict:
    """Both models on the same tokens [1, T] (eval mode); see the module docstring."""
    if not attn_res_model.cfg.attn_res or plain_model.cfg.attn_res:
        raise ValueError("models: expected an AttnRes model first and a plain residual model second")
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[0] == 1):
        raise ValueError(f"tokens: expected an int64 tensor [1, T], got {getattr(tokens, 'shape', type(tokens).__name__)}")
    attn_res_model.eval()
    plain_model.eval()
    return {"attn_res": _attn_res_side(attn_res_model, tokens), "plain": _plain_side(plain_model, tokens)}


def load() -> dict:
    """The committed lens; a missing or malformed file is one ValueError naming it."""
    path = resources.files("evict.explore").joinpath(DATA)
    data = read_json_object(cast(Path, path), "depth lens")  # the package is installed as files
    for key in ("command", "text", "attn_res", "plain", "training"):
        if key not in data:
            raise ValueError(f"depth lens: {path} lacks {key!r} (rerun python dev/depth_lens.py)")
    return data
