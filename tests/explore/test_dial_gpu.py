"""The chunk dial's GPU measurement (dev/chunk_dial_gpu.py) at a small shape: every chunk size runs on CUDA and gives
the same output as the float64 reference, so the committed timings are of a correct op."""

import pytest
import torch

from evict.explore import dial
from evict.ops import memory


@pytest.mark.gpu
def test_chunk_dial_on_cuda_every_size_matches_reference():
    shape = dial.Dial(T=128, H=2, D=32, B=2, repeats=1)
    x = dial.inputs(shape, device="cuda", dtype=torch.float32)
    x64 = {k: v.double().cpu() for k, v in x.items()}
    ref, _ = memory(x64["q"], x64["k"], x64["v"], log_alpha=x64["log_alpha"], beta=x64["beta"], delta=True, impl="reference")
    for C in shape.sizes():
        o, _ = memory(x["q"], x["k"], x["v"], log_alpha=x["log_alpha"], beta=x["beta"], delta=True, impl="chunked", chunk_size=C)
        assert (o.double().cpu() - ref).abs().max() <= 1e-3 * ref.abs().max(), C
        assert dial.time_chunk(shape, C, x) > 0
