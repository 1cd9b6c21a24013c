"""evict: attention is an associative memory; a fixed-size memory must evict."""

__version__ = "0.1.0"
