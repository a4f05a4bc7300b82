"""PyTorch peer of scripts/bench/decode.lua: a GPT-2-style model (pre-norm
LayerNorm, GELU MLP, tied head, random init) generating with a preallocated
KV cache in a plain eager loop: one forward per token at batch B, then top-k
50 sampling at temperature 1 (or argmax with --greedy). Prints one JSON line
per batch size: {"batch": B, "torch_tokens_per_s": ..., "seconds": ...}
(new tokens of every row over the whole call, prefill included; median of
--reps calls after a warm-up call).

  python3 scripts/bench/torch_decode.py --n-embd 768 --n-layer 12 --n-head 12 --batches 1,16 --max-new 200"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402  (the block of the training peer)


class Block(torch_peer.Block):
    """torch_peer's block with a KV cache: keys and values of positions pos.. written in place."""

    def forward(self, x, kc, vc, pos):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        kc[:, :, pos:pos + T] = k
        vc[:, :, pos:pos + T] = v
        y = F.scaled_dot_product_attention(q, kc[:, :, :pos + T], vc[:, :, :pos + T], is_causal=T > 1)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(torch_peer.GPT):
    """torch_peer's GPT with cached blocks and a forward at position pos."""

    def __init__(self, vocab, block, d, layers, heads):
        super().__init__(vocab, block, d, layers, heads)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0, 0.02)

    def forward(self, idx, caches, pos):
        x = self.wte(idx) + self.wpe(torch.arange(pos, pos + idx.shape[1], device=idx.device))
        for b, (kc, vc) in zip(self.blocks, caches):
            x = b(x, kc, vc, pos)
        return self.head(self.ln(x))


@torch.no_grad()
def generate(model, prompt, B, max_new, heads, d, dtype, greedy, dev):
    idx = prompt.expand(B, -1).contiguous()
    P = idx.shape[1]
    cap = P + max_new
    caches = [(torch.empty(B, heads, cap, d // heads, device=dev, dtype=dtype),
               torch.empty(B, heads, cap, d // heads, device=dev, dtype=dtype)) for _ in model.blocks]
    out = torch.empty(B, cap, dtype=torch.long, device=dev)
    out[:, :P] = idx
    logits = model(idx, caches, 0)[:, -1]
    for t in range(max_new):
        if greedy:
            nxt = logits.argmax(-1)
        else:
            v, i = torch.topk(logits.float(), 50, dim=-1)
            nxt = i.gather(1, torch.multinomial(F.softmax(v, dim=-1), 1)).squeeze(1)
        out[:, P + t] = nxt
        if t == max_new - 1:
            break
        logits = model(nxt.view(B, 1), caches, P + t)[:, -1]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-new", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--greedy", action="store_true")
    a = p.parse_args()
    dev = "cuda"
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    torch.manual_seed(1)
    model = GPT(a.vocab, a.block, a.n_embd, a.n_layer, a.n_head).to(dev, dtype).eval()
    prompt = torch.tensor([[(i * 7) % a.vocab for i in range(1, a.prompt_len + 1)]], device=dev)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}))
    for b in a.batches.split(","):
        B = int(b)
        generate(model, prompt, B, a.max_new, a.n_head, a.n_embd, dtype, a.greedy, dev)
        ts = []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(model, prompt, B, a.max_new, a.n_head, a.n_embd, dtype, a.greedy, dev)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        t = statistics.median(ts)
        print(json.dumps({"batch": B, "torch_tokens_per_s": round(B * a.max_new / t, 1), "seconds": round(t, 4)}))


if __name__ == "__main__":
    main()
