"""nn.Modules built on evict.ops: mixers, FFNs, norms, conv."""
