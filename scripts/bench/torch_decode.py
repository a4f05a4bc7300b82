"""PyTorch peer of scripts/bench/decode.lua: a gpt-fast-style decode loop.

A GPT-2-style model (--arch gpt: pre-norm LayerNorm, GELU MLP, learned
positions, tied head) or a Llama (--arch llama: RMSNorm, rotary positions,
grouped-query attention, SwiGLU, tied head or not), random init, generating
with a static KV cache (buffers of the prompt + max_new positions written in
place, attention over all of them with a mask), one step per token at batch B:
the forward of one token, then top-k 50 sampling at temperature 1 (top-p on
top with --top-p < 1; argmax with --greedy) drawn without a host sync
(argmax of p / Exp(1) noise, as gpt-fast does). Two modes in one process:
eager, and the step compiled with torch.compile(mode="reduce-overhead",
fullgraph=True) (CUDA graphs; the prefill runs eagerly in both). Prints one
JSON line per batch size: {"batch": B, "torch_tokens_per_s": eager,
"compile_tokens_per_s": compiled, ...} (new tokens of every row over the
whole call, prefill included; median of --reps calls after a warm-up call).

  python3 scripts/bench/torch_decode.py --arch llama --hidden 576 --inter 1536 --layers 30 --heads 9 --kv-heads 3 \
      --vocab 49152 --tied --bf16 --batches 1,8,32 --max-new 256 --top-p 0.9"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Cache(nn.Module):
    """keys and values of B rows x cap positions, written at positions pos in place"""

    def __init__(self, B, hkv, cap, hd, dtype, dev):
        super().__init__()
        self.register_buffer("k", torch.zeros(B, hkv, cap, hd, dtype=dtype, device=dev), persistent=False)
        self.register_buffer("v", torch.zeros(B, hkv, cap, hd, dtype=dtype, device=dev), persistent=False)

    def update(self, pos, k, v):
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k, self.v


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        d, self.h, self.hkv = a.hidden, a.heads, a.kv_heads
        self.hd = d // a.heads
        self.llama = a.arch == "llama"
        bias = not self.llama
        norm = (lambda: nn.RMSNorm(d, eps=1e-5)) if self.llama else (lambda: nn.LayerNorm(d))
        self.n1, self.n2 = norm(), norm()
        self.qkv = nn.Linear(d, (self.h + 2 * self.hkv) * self.hd, bias=bias)
        self.o = nn.Linear(self.h * self.hd, d, bias=bias)
        self.up = nn.Linear(d, (2 if self.llama else 1) * a.inter, bias=bias)
        self.down = nn.Linear(a.inter, d, bias=bias)
        self.cache = None

    def forward(self, x, pos, mask, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.h * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        q = q.view(B, T, self.h, self.hd).transpose(1, 2)
        k = k.view(B, T, self.hkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.hkv, self.hd).transpose(1, 2)
        if self.llama:
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        kc, vc = self.cache.update(pos, k, v)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=self.hkv != self.h)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, self.h * self.hd))
        if self.llama:
            g, u = self.up(self.n2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u)
        return x + self.down(F.gelu(self.up(self.n2(x)), approximate="tanh"))


class Model(nn.Module):
    def __init__(self, a, cap):
        super().__init__()
        self.a = a
        self.llama = a.arch == "llama"
        self.wte = nn.Embedding(a.vocab, a.hidden)
        if not self.llama:
            self.wpe = nn.Embedding(a.block, a.hidden)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = nn.RMSNorm(a.hidden, eps=1e-5) if self.llama else nn.LayerNorm(a.hidden)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False)
        if a.tied:
            self.head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0, 0.02)
        hd = a.hidden // a.heads
        inv = 1.0 / (a.theta ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.outer(torch.arange(cap).float(), inv)
        f = torch.cat((f, f), dim=-1)
        self.register_buffer("cos", f.cos(), persistent=False)
        self.register_buffer("sin", f.sin(), persistent=False)
        self.register_buffer("causal", torch.ones(cap, cap, dtype=torch.bool).tril(), persistent=False)
        self.cap, self.B = cap, 0

    def setup_caches(self, B, dtype, dev):
        if self.B == B:
            return  # kept: stale positions beyond the current one are masked
        hd = self.a.hidden // self.a.heads
        for b in self.blocks:
            b.cache = Cache(B, self.a.kv_heads, self.cap, hd, dtype, dev)
        self.B = B

    def forward(self, idx, pos):
        x = self.wte(idx)
        if not self.llama:
            x = x + self.wpe(pos)
        mask = self.causal[pos][None, None]
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)
        for b in self.blocks:
            x = b(x, pos, mask, cos, sin)
        return self.head(self.norm(x))


def sample(logits, greedy, top_p):
    if greedy:
        return logits.argmax(-1)
    v, i = torch.topk(logits.float(), 50, dim=-1)  # sorted, largest first
    p = F.softmax(v, dim=-1)
    if top_p < 1:
        p = p * ((p.cumsum(-1) - p) < top_p)
    j = (p / torch.empty_like(p).exponential_(1)).argmax(-1, keepdim=True)
    return i.gather(-1, j).squeeze(-1)


def decode_one(model, tok, pos, greedy, top_p):
    return sample(model(tok, pos)[:, -1], greedy, top_p)


@torch.no_grad()
def generate(model, step, prompt, B, a, dtype, dev):
    model.setup_caches(B, dtype, dev)
    P = prompt.shape[1]
    out = torch.empty(B, P + a.max_new, dtype=torch.long, device=dev)
    out[:, :P] = prompt
    nxt = decode_one(model, prompt.expand(B, -1), torch.arange(P, device=dev), a.greedy, a.top_p)
    out[:, P] = nxt
    pos = torch.tensor([P], device=dev)
    for t in range(1, a.max_new):
        nxt = step(model, nxt.view(B, 1), pos, a.greedy, a.top_p).clone()
        out[:, P + t] = nxt
        pos += 1
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="gpt", choices=["gpt", "llama"])
    p.add_argument("--hidden", "--n-embd", type=int, default=768)
    p.add_argument("--layers", "--n-layer", type=int, default=12)
    p.add_argument("--heads", "--n-head", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=0, help="0: as --heads")
    p.add_argument("--inter", type=int, default=0, help="MLP width (0: 4 * hidden)")
    p.add_argument("--theta", type=float, default=10000.0)
    p.add_argument("--tied", action="store_true", help="head tied to the embedding (always for gpt)")
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-new", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--modes", default="eager,compile")
    a = p.parse_args()
    a.kv_heads = a.kv_heads or a.heads
    a.inter = a.inter or 4 * a.hidden
    a.tied = a.tied or a.arch == "gpt"
    dev = "cuda"
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    torch.manual_seed(1)
    model = Model(a, a.prompt_len + a.max_new).to(dev, dtype).eval()
    model.cos, model.sin = model.cos.float(), model.sin.float()
    prompt = torch.tensor([[(i * 7) % a.vocab for i in range(1, a.prompt_len + 1)]], device=dev)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "arch": a.arch,
                      "params_mb": round(sum(t.numel() * t.element_size() for t in model.parameters()) / 1e6, 1)}))
    steps = {}
    for m in a.modes.split(","):
        steps[m] = decode_one if m == "eager" else torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    for b in a.batches.split(","):
        B = int(b)
        row = {"batch": B}
        for m, step in steps.items():
            t0 = time.perf_counter()
            generate(model, step, prompt, B, a, dtype, dev)  # warm-up (compiles and records the graphs)
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            ts = []
            for _ in range(a.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                generate(model, step, prompt, B, a, dtype, dev)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            t = statistics.median(ts)
            key = "torch" if m == "eager" else m
            row[key + "_tokens_per_s"] = round(B * a.max_new / t, 1)
            row[key + "_s"] = round(t, 4)
            row[key + "_warmup_s"] = round(warm, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
