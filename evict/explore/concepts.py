"""The concept map: the lesson's 18 ideas in four groups, each linked to the figure that shows it and the `evict`
command that computes it, and the problem → solution links between them."""

from __future__ import annotations

GROUPS = ("memory frame", "update rules", "hardware", "full system")
FIGURES = ("concept-map", "memory-wall", "history-fold", "whiteboard", "delta-stamp", "chunk-dial", "fade-curve",
           "twin-boards", "param-accountant", "layer-map", "depth-lens")

# (id, group, idea, figure or None, command)
NODES = (
    ("kv-cache", "memory frame", "Attention keeps every token: the KV cache", "history-fold", "evict bench decode"),
    ("memory-wall", "memory frame", "The memory wall: KV bytes grow with the context", "memory-wall", "evict size gpt2_124m kimi_k3"),
    ("fold", "memory frame", "Fold the history into one fixed state S", "history-fold", "evict demo"),
    ("interference", "memory frame", "Interference: overlapping keys blur a read", "whiteboard", "evict demo"),
    ("capacity", "memory frame", "Capacity: about d_key facts per state", None, "evict lab capacity --quick"),
    ("delta", "update rules", "Delta rule: read, subtract, write", "delta-stamp", "evict demo"),
    ("sgd", "update rules", "The delta update is one SGD step on ½‖kS − v‖²", None, "evict demo"),
    ("scalar-gate", "update rules", "Scalar gate: every fact fades together", "fade-curve", "evict recall --quick --archs gated_deltanet"),
    ("channel-gate", "update rules", "Per-channel gate (KDA): fade some channels, keep others", "twin-boards", "evict recall --quick --archs kda"),
    ("neg-eigval", "update rules", "β up to 2: negative eigenvalues keep a running state", None, "evict lab state --quick"),
    ("chunked", "hardware", "Chunked form: intra-chunk tiles + history folded into S", "chunk-dial", "evict bench ops"),
    ("decode-step", "hardware", "Decode: one fixed-size step per token", None, "evict bench decode"),
    ("kernels", "hardware", "GPU kernels for the chunked and step forms", None, "evict bench ops --device auto"),
    ("hybrid", "full system", "Hybrid stack: three KDA layers to one MLA", "layer-map", "evict size kimi_linear_48b"),
    ("mla", "full system", "MLA: cache a 576-number latent per token", "memory-wall", "evict size kimi_k3"),
    ("moe", "full system", "MoE: trillions stored, tens of billions active", "param-accountant", "evict size kimi_k3"),
    ("attn-res", "full system", "AttnRes: attention over depth", "depth-lens", "evict train --preset k3_mini"),
    ("recall", "full system", "Measure it: recall as the memory fills", None, "evict recall --quick"),
)

# (problem, solution, why): the problem → solution links
LINKS = (
    ("kv-cache", "memory-wall", "every token stays"),
    ("memory-wall", "fold", "bytes grow with context"),
    ("memory-wall", "mla", "or shrink each token's cache"),
    ("fold", "interference", "a fixed board is shared"),
    ("interference", "capacity", "how many facts fit"),
    ("interference", "delta", "erase what the key reads"),
    ("delta", "sgd", "why it works"),
    ("delta", "scalar-gate", "stale facts never fade"),
    ("scalar-gate", "channel-gate", "one knob fades everything"),
    ("delta", "neg-eigval", "β ∈ [0, 1] cannot flip a sign"),
    ("fold", "chunked", "a token loop starves a GPU"),
    ("fold", "decode-step", "generation is one token at a time"),
    ("chunked", "kernels", "PyTorch launches too many ops"),
    ("channel-gate", "hybrid", "a fixed memory still forgets"),
    ("hybrid", "mla", "the attention layers' cache"),
    ("hybrid", "moe", "capacity from parameters, not state"),
    ("hybrid", "attn-res", "deep stacks dilute early layers"),
    ("hybrid", "recall", "does it remember?"),
)


def concept_map() -> dict:
    nodes = [{"id": i, "group": g, "idea": idea, "figure": fig, "command": cmd} for i, g, idea, fig, cmd in NODES]
    links = [{"from": a, "to": b, "why": why} for a, b, why in LINKS]
    return {"groups": list(GROUPS), "figures": list(FIGURES), "nodes": nodes, "links": links}
