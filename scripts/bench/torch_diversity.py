"""PyTorch eager peer of scripts/bench/diversity.lua: the mean pairwise cosine
distance 1 - cos over the upper triangle of one set of n embeddings of width d
(default n = 64, d = 384), the way it is usually written in eager PyTorch:
normalize, the Gram matrix, the upper-triangle entries, their mean. Prints µs
per call (CUDA events, after warm-up), forward and forward + backward, and a
batched version over 64 sets for reference.

    python3 scripts/bench/torch_diversity.py [n] [d]
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402  (its timing loop)


def pairwise_cosine_distance(x, iu):
    u = F.normalize(x, dim=-1)
    sim = u @ u.transpose(-1, -2)
    return (1 - sim[..., iu[0], iu[1]]).mean(-1)


def bench(fn):
    """Median µs per call (CUDA events after warm-up, as torch_peer times)."""
    return torch_peer.time_steps(fn, warmup=20, iters=200) * 1e3


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    d = int(sys.argv[2]) if len(sys.argv) > 2 else 384
    dev = "cuda"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, n = {n}, d = {d}")
    iu = torch.triu_indices(n, n, 1, device=dev)
    for dt in (torch.float32, torch.bfloat16):
        name = "f32" if dt == torch.float32 else "bf16"
        for S in (1, 64):
            x = torch.randn(S, n, d, device=dev, dtype=dt)
            xs = x[0] if S == 1 else x
            us = bench(lambda: pairwise_cosine_distance(xs.float(), iu))
            print(f"{'torch eager forward':26s} {name:5s} S={S:<3d} {us:9.2f} us")
            xg = xs.float().clone().requires_grad_()

            def fb():
                xg.grad = None
                pairwise_cosine_distance(xg, iu).sum().backward()

            us = bench(fb)
            print(f"{'torch eager fwd+bwd':26s} {name:5s} S={S:<3d} {us:9.2f} us")


if __name__ == "__main__":
    main()
