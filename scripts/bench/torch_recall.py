"""The Titans recall task's full-attention baseline in PyTorch: the task of
scripts/titans.lua --task recall (8 key-value pairs in random digits,
sequences of 256, the queries after a gap drawn from 0 to 224, the loss on
the values after the queried keys) and the model of its `full` run (byte
embeddings, pre-norm blocks of RMSNorm, one qkv product, rotary q and k,
causal SDPA, an MLP of GELU (tanh) with biases; AdamW betas 0.9/0.95, weight
decay 0.1 on matrices, cosine schedule with warm-up, clipping at 1, bf16
autocast). It tells whether a result of gpush's full-attention model is the
task's or gpush's: both should land at the same accuracy.

  python3 scripts/bench/torch_recall.py --steps 1500 [--dim 128 --layers 2 --heads 2 --mlp-hidden 875]

`titans.lua --task recall --peer` runs it with the run's own flags and
prints its accuracy by gap beside gpush's models.
"""
import argparse
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

KEY0, VAL0, NKEY, NVAL = 65, 97, 26, 26


def recall_batch(rng, B, T, P, gap=None):
    """x, y (B, T) as titans.lua's recall_batch: filler digits, the pairs, the gap, the queries (y -100 but
    at the queried keys, where it is the value)."""
    max_gap = T - 4 * P
    x = torch.empty(B, T, dtype=torch.long)
    y = torch.full((B, T), -100, dtype=torch.long)
    for b in range(B):
        g = rng.randint(0, max_gap) if gap is None else gap
        p0 = T - 4 * P - g
        qstart = p0 + 2 * P + g
        keys = rng.sample(range(NKEY), P)
        vals = [rng.randint(0, NVAL - 1) for _ in range(P)]
        seq = [48 + rng.randint(0, 9) for _ in range(T)]
        for i in range(P):
            seq[p0 + 2 * i] = KEY0 + keys[i]
            seq[p0 + 2 * i + 1] = VAL0 + vals[i]
        order = list(range(P))
        rng.shuffle(order)
        for i, j in enumerate(order):
            seq[qstart + 2 * i] = KEY0 + keys[j]
            seq[qstart + 2 * i + 1] = VAL0 + vals[j]
            y[b, qstart + 2 * i] = VAL0 + vals[j]
        x[b] = torch.tensor(seq)
    return x, y


def rope(t, inv_freq):
    """t (B, L, H, D) turned in the planes (i, i + D/2) by position * inv_freq[i] (gp.rope's layout)."""
    L, D = t.shape[1], t.shape[3]
    ang = torch.arange(L, device=t.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = t[..., : D // 2].float(), t[..., D // 2:].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(t.dtype)


class Block(nn.Module):
    def __init__(self, C, H, hidden):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.RMSNorm(C, eps=1e-5), nn.RMSNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C, bias=False)
        self.proj = nn.Linear(C, C, bias=False)
        self.fc, self.out = nn.Linear(C, hidden), nn.Linear(hidden, C)

    def forward(self, x, inv_freq):
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.H, C // self.H).unbind(2)
        q, k = rope(q, inv_freq), rope(k, inv_freq)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class LM(nn.Module):
    def __init__(self, C, layers, H, hidden):
        super().__init__()
        self.wte = nn.Embedding(256, C)
        self.h = nn.ModuleList(Block(C, H, hidden) for _ in range(layers))
        self.ln_f = nn.RMSNorm(C, eps=1e-5)
        self.head = nn.Linear(C, 256, bias=False)
        nn.init.normal_(self.wte.weight, 0, 0.02)
        hd = C // H
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), persistent=False)

    def forward(self, x):
        h = self.wte(x)
        for blk in self.h:
            h = blk(h, self.inv_freq)
        return self.head(self.ln_f(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--mlp-hidden", type=int, default=875, help="titans.lua's full model widened to MAC's parameters")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--gaps", default="", help="gaps to measure, comma-separated (default 0, 16, 32, 64, 128, the longest)")
    p.add_argument("--eval-batches", type=int, default=8)
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    m = LM(a.dim, a.layers, a.heads, a.mlp_hidden).to(dev)
    decay = [q for q in m.parameters() if q.dim() >= 2]
    rest = [q for q in m.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    warm = min(100, a.steps // 10)

    def lr_at(s):
        if s <= warm:
            return a.lr * s / warm
        f = (s - warm) / max(1, a.steps - warm)
        return a.lr / 10 + (a.lr - a.lr / 10) * 0.5 * (1 + math.cos(math.pi * f))

    print(f"torch_recall: {sum(q.numel() for q in m.parameters())} parameters, dim {a.dim}, {a.layers} layers, "
          f"{a.heads} heads, seq {a.seq}, {a.pairs} pairs, batch {a.batch}, {a.steps} steps, lr {a.lr}, {dev}", flush=True)
    for s in range(1, a.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        x, y = recall_batch(rng, a.batch, a.seq, a.pairs)
        x, y = x.to(dev), y.to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = m(x)
        loss = F.cross_entropy(logits.float().view(-1, 256), y.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        if s % max(1, a.steps // 10) == 0:
            print(f"step {s}: loss {loss.item():.4f}", flush=True)
    m.eval()
    max_gap = a.seq - 4 * a.pairs
    gaps = [int(g) for g in a.gaps.split(",")] if a.gaps else [0, 16, 32, 64, 128, max_gap]
    accs = []
    with torch.no_grad():
        for g in gaps:
            hit = n = 0
            for _ in range(a.eval_batches):
                x, y = recall_batch(rng, a.batch, a.seq, a.pairs, g)
                x, y = x.to(dev), y.to(dev)
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    pred = m(x).argmax(-1)
                mask = y != -100
                hit += (pred[mask] == y[mask]).sum().item()
                n += mask.sum().item()
            accs.append(hit / n)
            print(f"gap {g:4d}: accuracy {hit / n:.3f}", flush=True)
    print(f"torch_recall accuracy: full {sum(accs) / len(accs):.3f} (mean over the gaps)")


if __name__ == "__main__":
    main()
