"""The chunk dial's GPU numbers: wall-clock of the chunked memory op per chunk size C on CUDA, written as JSON.

    python dev/chunk_dial_gpu.py [--out evict/explore/data/chunk_dial_gpu.json]

Same op as the dial measures on the reader's CPU (gated delta rule, scalar gate, forward, impl="chunked": the
PyTorch chunked form, since the Triton kernels fix C = 64), at B4 T1024 H16 D128
in bfloat16 (state and decays float32), C = 1 … 1024, median of 5 after a warm-up. `evict explore` shows the file
beside the local measurement; commit it with the card it records.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from evict.explore.dial import GPU_DATA, Dial, cost, inputs, time_chunk
from evict.report import card


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "evict" / "explore" / GPU_DATA))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("chunk_dial_gpu: error: CUDA is not available on this machine", file=sys.stderr)
        return 2
    dial = Dial(T=1024, H=16, D=128, B=4, repeats=5)
    x = inputs(dial, device="cuda", dtype=torch.bfloat16)
    seconds = []
    for C in dial.sizes():
        seconds.append(time_chunk(dial, C, x))
        print(f"C={C:5d}  {seconds[-1] * 1e3:9.3f} ms  {cost(dial, C)['flops'] / 1e9:7.2f} GFLOP")
    payload = {"sizes": dial.sizes(), "seconds": seconds, "shape": asdict(dial), "card": card(),
               "dtype": "bfloat16 inputs, float32 state", "command": "python dev/chunk_dial_gpu.py",
               "op": "memory(delta=True, scalar gate, impl='chunked'), forward"}
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
