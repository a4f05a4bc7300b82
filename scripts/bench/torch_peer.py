"""The PyTorch side of gpush's benchmarks: the same workload in PyTorch eager
and torch.compile, timed the same way (CUDA events, warm-up, median).

  python3 scripts/bench/torch_peer.py gpt --n-embd 128 --n-layer 4 --n-head 4 \
      --block 64 --batch 16 --vocab 51 [--bf16] [--compile]

prints one line per mode: `gpt eager ms_per_step tokens_per_s`.

  python3 scripts/bench/torch_peer.py attention --batch 4 --heads 16 --seq 4096 --head-dim 64

times F.scaled_dot_product_attention (bf16, causal) forward and forward +
backward; prints `attention fwd ms` and `attention fwd_bwd ms`."""
import argparse
import math
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, d, layers, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def time_steps(step, warmup=10, iters=50):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gpt(args):
    torch.manual_seed(0)
    dev = "cuda"
    model = GPT(args.vocab, args.block, args.n_embd, args.n_layer, args.n_head).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    x = torch.randint(0, args.vocab, (args.batch, args.block), device=dev)
    y = torch.randint(0, args.vocab, (args.batch, args.block), device=dev)
    modes = [("eager", model)]
    if args.compile:
        modes.append(("compile", torch.compile(model)))
    for name, m in modes:
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
                loss = m(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        ms = time_steps(step)
        print(f"gpt {name} {ms:.3f} {args.batch * args.block / ms * 1e3:.0f}", flush=True)


def attention(args):
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dout)

    print(f"attention fwd {time_steps(fwd):.4f}", flush=True)
    print(f"attention fwd_bwd {time_steps(fwd_bwd):.4f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=["gpt", "attention"])
    for k, v in dict(n_embd=128, n_layer=4, n_head=4, block=64, batch=16, vocab=51, heads=16, seq=4096,
                     head_dim=64).items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    if args.workload == "attention":
        attention(args)
    else:
        gpt(args)
