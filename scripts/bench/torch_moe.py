"""PyTorch peer of scripts/bench/moe.lua: a Mixtral-style MoE layer in eager
mode (router softmax in f32, top-k, renormalized weights, a Python loop over
the experts that selects each expert's tokens, runs its SwiGLU or GELU MLP and
index_adds the weighted result back, the Switch load-balancing and z losses),
forward and forward + backward, timed with CUDA events (warm-up, median).

  python3 scripts/bench/torch_moe.py --tokens 8192 --d 768 --hidden 2048 --experts 8 --k 2 [--act swiglu] [--dtype bf16]

prints `torch_moe fwd MS ms TOKENS tokens/s` and `torch_moe fwd_bwd MS ms TOKENS tokens/s`."""
import argparse
import statistics

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class MoE(torch.nn.Module):
    def __init__(self, d, h, e, k, act, dt, dev):
        super().__init__()
        self.e, self.k, self.act = e, k, act
        self.router = torch.nn.Linear(d, e, bias=False, device=dev, dtype=dt)
        self.w1 = torch.nn.Parameter(torch.randn(e, d, h, device=dev, dtype=dt) * d ** -0.5)
        self.w3 = torch.nn.Parameter(torch.randn(e, d, h, device=dev, dtype=dt) * d ** -0.5) if act == "swiglu" else None
        self.w2 = torch.nn.Parameter(torch.randn(e, h, d, device=dev, dtype=dt) * h ** -0.5)

    def forward(self, x):
        n = x.shape[0]
        logits = self.router(x).float()
        probs = torch.softmax(logits, -1)
        topv, topi = probs.topk(self.k, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(self.e):  # the Mixtral (HF) loop: one expert at a time
            tok, slot = torch.where(topi == e)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            if self.act == "swiglu":
                he = F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])
            else:
                he = F.gelu(xe @ self.w1[e], approximate="tanh")
            ye = (he @ self.w2[e]) * topv[tok, slot].unsqueeze(-1).to(x.dtype)
            y.index_add_(0, tok, ye)
        f = torch.bincount(topi.flatten(), minlength=self.e).float() / (n * self.k)
        aux = self.e * (f * probs.mean(0)).sum() * 0.01 + torch.logsumexp(logits, -1).pow(2).mean() * 1e-3
        return y, aux


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(iters):
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--act", default="swiglu")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("torch_moe: no CUDA GPU")
        return
    dev, dt = "cuda", DTYPES[a.dtype]
    torch.manual_seed(0)
    m = MoE(a.d, a.hidden, a.experts, a.k, a.act, dt, dev)
    x = torch.randn(a.tokens, a.d, device=dev, dtype=dt, requires_grad=True)
    proj = torch.randn(a.tokens, a.d, device=dev, dtype=dt)

    def fwd():
        with torch.no_grad():
            m(x)

    def fwd_bwd():
        y, aux = m(x)
        ((y * proj).sum().float() + aux).backward()
        m.zero_grad(set_to_none=True)
        x.grad = None

    tf = timed(fwd, 3, a.iters)
    tfb = timed(fwd_bwd, 3, a.iters)
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
    print(f"torch_moe fwd {tf:.4f} ms {a.tokens / tf * 1e3:.0f} tokens/s")
    print(f"torch_moe fwd_bwd {tfb:.4f} ms {a.tokens / tfb * 1e3:.0f} tokens/s")


if __name__ == "__main__":
    main()
