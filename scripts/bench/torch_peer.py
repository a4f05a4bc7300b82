"""The PyTorch side of gpush's benchmarks: the same workload in PyTorch eager
and torch.compile, timed the same way (CUDA events, warm-up, median, inputs
rotated over the same number of buffer sets as the gpush side).

  python3 scripts/bench/torch_peer.py run WORKLOAD --cases FILE [--device cuda] [--no-compile]

reads a JSON list of cases (each has a "key", the row's shape label, and the
workload's parameters; scripts/bench/suite.lua writes it) and prints one JSON
line per case:

  {"workload": ..., "shape": KEY, "eager_ms": ..., "compile_ms": ...}

(plus "error" / "compile_error" when a mode failed; its time is then null).
A first line {"torch": VERSION, "cuda": ..., "device": NAME} says what ran.
Times are milliseconds per call (per op for the dispatch workload).

  python3 scripts/bench/torch_peer.py gpt --n-embd 128 --n-layer 4 --n-head 4 \\
      --block 64 --batch 16 --vocab 51 [--bf16] [--compile] [--clip 1.0]

prints one line per mode: `gpt eager ms_per_step tokens_per_s`.

  python3 scripts/bench/torch_peer.py attention --batch 4 --heads 16 --seq 4096 --head-dim 64

times F.scaled_dot_product_attention (bf16, causal) forward and forward +
backward; prints `attention fwd ms` and `attention fwd_bwd ms`.

  python3 scripts/bench/torch_peer.py attention-grid --cells FILE [--runs 3] [--iters 20]

reads a JSON list of cells {"key", "b", "h", "hkv", "t", "d", "causal"}
(scripts/bench/attention.lua --grid writes it) and times, in this one
process, F.scaled_dot_product_attention(q, k, v, is_causal=causal,
enable_gqa=hkv != h) on bf16 q (b, h, t, d), k, v (b, hkv, t, d): forward
(no_grad) and forward + backward, each `runs` times (a run: time_steps'
median over `iters`). Prints a first line {"torch", "cuda", "device"}, then
one JSON line per cell: {"key", ..., "fwd_ms", "fb_ms" (the medians of the
runs), "fwd_runs", "fb_runs", "backend_fwd", "backend_fb" (the aten SDPA op
that ran: flash, efficient, cudnn, math; null when unknown)} and "error"
when the cell failed (its times then null)."""
import argparse
import gc
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class Block(nn.Module):
    """Pre-norm block: GPT-2's (LayerNorm, GELU, biases) or, with mlp="swiglu",
    norm="rms" and bias=False, a Llama-shaped one (as gpush's nn.GPT)."""

    def __init__(self, d, h, mlp="gelu", hidden=None, norm="layer", bias=True):
        super().__init__()
        hidden = hidden or 4 * d
        mk = (lambda: nn.RMSNorm(d, eps=1e-5)) if norm == "rms" else (lambda: nn.LayerNorm(d, bias=bias))
        self.ln1, self.ln2 = mk(), mk()
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)
        self.swiglu = mlp == "swiglu"
        self.fc = nn.Linear(d, (2 if self.swiglu else 1) * hidden, bias=bias)
        self.out = nn.Linear(hidden, d, bias=bias)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        if self.swiglu:
            g, u = self.fc(self.ln2(x)).chunk(2, dim=-1)
            return x + self.out(F.silu(g) * u)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, d, layers, heads, mlp="gelu", hidden=None, norm="layer", bias=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, mlp, hidden, norm, bias) for _ in range(layers))
        self.ln = nn.RMSNorm(d, eps=1e-5) if norm == "rms" else nn.LayerNorm(d, bias=bias)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def time_steps(step, warmup=10, iters=50, dev="cuda"):
    """Median ms of step() after warm-up: CUDA events on the GPU, the host
    clock on the CPU (gpush's gp.time does the same)."""
    for _ in range(warmup):
        step()
    sync(dev)
    times = []
    for _ in range(iters):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def maybe_compile(fn, compiled):
    return torch.compile(fn, dynamic=False) if compiled else fn


def rotating(fn, sets):
    """step() calls fn on the next set of arguments (inputs rotated so that
    the L2 holds none of them between calls)."""
    i = [0]

    def step():
        args = sets[i[0] % len(sets)]
        i[0] += 1
        return fn(*args)

    return step


def rand(shape, dt, dev):
    # positive values in [0.5, 1.5), like gpush's rand_uniform(0.5, 1.5)
    return (torch.rand(shape, device=dev, dtype=torch.float32) + 0.5).to(dt)


# --------------------------------------------------------------------------
# workloads: build(case, dev, compiled) -> step (timed by time_steps)

def ew_add(a, b):
    return a + b


def ew_mul(a, b):
    return a * b


def ew_exp(a):
    return torch.exp(a)


def ew_swiglu(g, u):
    return F.silu(g) * u


def ew_rms_norm(x, w):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, 1e-5)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def ew_softmax(x):
    return torch.softmax(x, -1)


def ew_layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


EW = {  # op: (function, number of row-shaped inputs, weights (D) after them)
    "add": (ew_add, 2, 0), "mul": (ew_mul, 2, 0), "exp": (ew_exp, 1, 0), "swiglu": (ew_swiglu, 2, 0),
    "rms_norm": (ew_rms_norm, 1, 1), "softmax": (ew_softmax, 1, 0), "layer_norm": (ew_layer_norm, 1, 2),
}


def build_elementwise(case, dev, compiled):
    fn, nin, nw = EW[case["op"]]
    dt, n, D = DTYPES[case["dtype"]], case["n"], case.get("D")
    shape = (n // D, D) if D else (n,)
    ws = [rand((shape[-1],), dt, dev) for _ in range(nw)]
    sets = [tuple(rand(shape, dt, dev) for _ in range(nin)) + tuple(ws) for _ in range(case.get("sets", 1))]
    return rotating(maybe_compile(fn, compiled), sets)


def mm(a, b):
    return a @ b


def build_matmul(case, dev, compiled):
    dt, M, N, K = DTYPES[case["dtype"]], case["m"], case["n"], case["k"]
    sets = [(rand((M, K), dt, dev), rand((K, N), dt, dev)) for _ in range(case.get("sets", 1))]
    return rotating(maybe_compile(mm, compiled), sets)


def ce(logits, targets):
    return F.cross_entropy(logits, targets)


def build_cross_entropy(case, dev, compiled):
    dt, N, V = DTYPES[case["dtype"]], case["n"], case["v"]
    sets = [(torch.randn(N, V, device=dev, dtype=dt).requires_grad_(), torch.randint(0, V, (N,), device=dev))
            for _ in range(case.get("sets", 1))]
    f = maybe_compile(ce, compiled)

    def fwd_bwd(logits, targets):
        logits.grad = None
        f(logits, targets).backward()

    return rotating(fwd_bwd, sets)


def distill_kl(s, t, T):
    return F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="batchmean") * T * T


def build_distill(case, dev, compiled):
    dt, N, V, T = DTYPES[case["dtype"]], case["n"], case["v"], case["temperature"]
    sets = [(torch.randn(N, V, device=dev, dtype=dt).requires_grad_(), torch.randn(N, V, device=dev, dtype=dt))
            for _ in range(case.get("sets", 1))]
    f = maybe_compile(distill_kl, compiled)

    def fwd_bwd(s, t):
        s.grad = None
        f(s, t, T).backward()

    return rotating(fwd_bwd, sets)


def head_ce(h, w, t):
    return F.cross_entropy(h @ w.t(), t)


def build_linear_cross_entropy(case, dev, compiled):
    dt, N, D, V = DTYPES[case["dtype"]], case["n"], case["d"], case["v"]
    h = torch.randn(N, D, device=dev, dtype=dt).requires_grad_()
    w = (torch.randn(V, D, device=dev, dtype=dt) * 0.02).requires_grad_()
    t = torch.randint(0, V, (N,), device=dev)
    f = maybe_compile(head_ce, compiled)

    def fwd_bwd():
        h.grad, w.grad = None, None
        f(h, w, t).backward()

    fwd_bwd.grad_inputs = (h, w)  # measure(): the peak above these and their gradients
    return fwd_bwd


def build_adamw(case, dev, compiled):
    if compiled:
        raise RuntimeError("not compiled: the fused AdamW is PyTorch's fastest step")
    torch.manual_seed(0)
    params = []
    for s in case["shapes"]:
        p = torch.empty(s, device=dev).normal_(0, 0.02).requires_grad_()
        p.grad = torch.randn_like(p)
        params.append(p)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    return opt.step


def make_gpt_step(c, dev, compiled, clip=0.0):
    """One training step: zero_grad, forward, backward, (clip), AdamW."""
    torch.manual_seed(0)
    model = GPT(c["vocab"], c["block"], c["n_embd"], c["n_layer"], c["n_head"], c.get("mlp", "gelu"),
                c.get("mlp_hidden"), c.get("norm", "layer"), c.get("bias", True)).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=dev == "cuda")
    x = torch.randint(0, c["vocab"], (c["batch"], c["block"]), device=dev)
    y = torch.randint(0, c["vocab"], (c["batch"], c["block"]), device=dev)
    m = torch.compile(model) if compiled else model
    bf16 = bool(c.get("bf16"))

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            loss = m(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_train(case, dev, compiled):
    return make_gpt_step(case, dev, compiled, case.get("clip", 0.0))


def build_attention(case, dev, compiled):
    dt, B, H, T, hd = DTYPES[case["dtype"]], case["b"], case["h"], case["t"], case["hd"]
    bwd = case.get("backward", False)

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    f = maybe_compile(attn, compiled)
    sets = []
    for _ in range(case.get("sets", 1)):
        q, k, v = (torch.randn(B, H, T, hd, device=dev, dtype=dt).requires_grad_(bwd) for _ in range(3))
        sets.append((q, k, v, torch.randn(B, H, T, hd, device=dev, dtype=dt)))
    if not bwd:
        return rotating(lambda q, k, v, dout: f(q, k, v), sets)

    def fwd_bwd(q, k, v, dout):
        q.grad = k.grad = v.grad = None
        f(q, k, v).backward(dout)

    return rotating(fwd_bwd, sets)


def build_decode(case, dev, compiled):
    # one decoding step of attention: a query per sequence against its KV cache
    dt, B, H, S, hd = DTYPES[case["dtype"]], case["b"], case["h"], case["s"], case["hd"]

    def dec(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    sets = [tuple(torch.randn(B, H, L, hd, device=dev, dtype=dt) for L in (1, S, S))
            for _ in range(case.get("sets", 1))]
    return rotating(maybe_compile(dec, compiled), sets)


def build_moe(case, dev, compiled):
    # top-k routed experts (GELU MLPs), the plain eager way: a loop over experts
    dt, N, D, Hd, E, K = DTYPES[case["dtype"]], case["tokens"], case["d"], case["hidden"], case["experts"], case["top_k"]
    torch.manual_seed(0)
    wr = torch.randn(D, E, device=dev, dtype=dt) * D ** -0.5
    w1 = torch.randn(E, D, Hd, device=dev, dtype=dt) * D ** -0.5
    w2 = torch.randn(E, Hd, D, device=dev, dtype=dt) * Hd ** -0.5

    def moe(x):
        probs = torch.softmax((x @ wr).float(), -1)
        topv, topi = probs.topk(K, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (topi == e).nonzero(as_tuple=True)
            h = F.gelu(x[tok] @ w1[e], approximate="tanh") @ w2[e]
            y.index_add_(0, tok, (h * topv[tok, slot].unsqueeze(-1)).to(y.dtype))
        return y

    sets = [(torch.randn(N, D, device=dev, dtype=dt),) for _ in range(case.get("sets", 1))]
    return rotating(maybe_compile(moe, compiled), sets)


def build_diversity(case, dev, compiled):
    # set diversity: mean pairwise cosine distance of n embeddings per prompt
    dt, P, N, D = DTYPES[case["dtype"]], case["prompts"], case["samples"], case["d"]

    def diversity(e):
        e = F.normalize(e.float(), dim=-1)
        sim = e @ e.transpose(-1, -2)
        return (N * N - sim.sum((-1, -2))) / (N * (N - 1))

    sets = [(torch.randn(P, N, D, device=dev, dtype=dt),) for _ in range(case.get("sets", 1))]
    return rotating(maybe_compile(diversity, compiled), sets)


def build_titans(case, dev, compiled):
    # the chunked Titans memory update over a sequence, forward + backward (scripts/bench/torch_titans.py)
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_titans
    _, fwdbwd = torch_titans.make_steps(case["kind"], case["batch"] * case["heads"], case["seq"], case["head_dim"],
                                        case["hidden"], case["chunk"], dev, compiled)
    return fwdbwd


def build_missing(case, dev, compiled):
    raise NotImplementedError("no PyTorch peer for this workload yet (write one in scripts/bench/torch_peer.py)")


def run_dispatch(case, dev, compiled):
    """Host microseconds per tiny op, as ms per op: n in-place adds on
    1-element tensors, then one synchronize."""
    if compiled:
        raise RuntimeError("not compiled: a per-op dispatch loop")
    a = torch.zeros(1, device=dev)
    b = torch.ones(1, device=dev)
    n = case["n"]
    scalar = case["op"] == "add_s"
    for _ in range(min(n, 1000)):
        a.add_(b)
    sync(dev)
    t0 = time.perf_counter()
    if scalar:
        for _ in range(n):
            a.add_(1.0)
    else:
        for _ in range(n):
            a.add_(b)
    sync(dev)
    return (time.perf_counter() - t0) * 1e3 / n


WORKLOADS = {
    "elementwise": build_elementwise, "matmul": build_matmul, "cross_entropy": build_cross_entropy,
    "distill": build_distill, "linear_cross_entropy": build_linear_cross_entropy, "adamw": build_adamw,
    "train": build_train, "attention": build_attention,
    "decode": build_decode,
    "moe": build_moe, "diversity": build_diversity, "titans": build_titans, "polychromic": build_missing,
}
HOST_TIMED = {"dispatch": run_dispatch}


def free(dev):
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def transient_peak(step):
    """Device bytes one step() holds at its peak beyond what lives before it
    and the gradients it leaves (step.grad_inputs: tensors whose .grad it sets)."""
    grads = 0
    for x in step.grad_inputs:
        x.grad = None
        grads += x.numel() * x.element_size()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - grads


def measure(workload, case, dev, compiled):
    """Median ms of the workload's step, and its transient peak bytes when
    the case asks for it (case peak, on the GPU) or None."""
    if workload in HOST_TIMED:
        return HOST_TIMED[workload](case, dev, compiled), None
    step = WORKLOADS[workload](case, dev, compiled)
    try:
        ms = time_steps(step, case.get("warmup", 3), case.get("iters", 20), dev)
        peak = transient_peak(step) if case.get("peak") and dev == "cuda" else None
        return ms, peak
    finally:
        del step
        free(dev)


def short(e):
    msg = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return msg[:300]


def run(args):
    dev = args.device
    with open(args.cases) as f:
        cases = json.load(f)
    try:  # one compiled function sees several dtypes and shapes: no recompile limit in the way
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    except Exception:  # noqa: BLE001 - an older or newer torch without that setting
        pass
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "device": name}), flush=True)
    for case in cases:
        out = {"workload": args.workload, "shape": case["key"], "eager_ms": None, "compile_ms": None,
               "eager_peak": None, "compile_peak": None}
        try:
            out["eager_ms"], out["eager_peak"] = measure(args.workload, case, dev, False)
        except Exception as e:  # noqa: BLE001 - every failure is reported, never fatal
            out["error"] = short(e)
        free(dev)
        if args.no_compile or case.get("compile") is False:
            out["compile_error"] = "skipped"
        else:
            try:
                out["compile_ms"], out["compile_peak"] = measure(args.workload, case, dev, True)
            except Exception as e:  # noqa: BLE001
                out["compile_error"] = short(e)
            free(dev)
        print(json.dumps(out), flush=True)


def gpt(args):
    dev = "cuda"
    c = dict(vocab=args.vocab, block=args.block, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
             batch=args.batch, bf16=args.bf16)
    modes = [("eager", False)] + ([("compile", True)] if args.compile else [])
    for name, compiled in modes:
        ms = time_steps(make_gpt_step(c, dev, compiled, args.clip))
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


SDPA_OPS = (("_scaled_dot_product_flash_attention", "flash"), ("_scaled_dot_product_cudnn_attention", "cudnn"),
            ("_scaled_dot_product_efficient_attention", "efficient"), ("_flash_attention_forward", "flash"),
            ("_efficient_attention_forward", "efficient"), ("_scaled_dot_product_attention_math", "math"))


def sdpa_backend(fn):
    """The SDPA backend that fn() runs, from the names of the aten ops the CPU
    profiler sees (None when the profiler or the names say nothing)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        sync("cuda")
        names = {e.key for e in prof.key_averages()}
    except Exception:  # noqa: BLE001 - optional information
        return None
    for op, name in SDPA_OPS:
        if any(op in n for n in names):
            return name
    return None


def attention_cell(c, runs, iters):
    b, h, hkv, t, d, causal = c["b"], c["h"], c["hkv"], c["t"], c["d"], bool(c["causal"])
    kw = {"is_causal": causal}
    if hkv != h:
        kw["enable_gqa"] = True  # torch >= 2.5; older: a TypeError, reported as the cell's error
    torch.manual_seed(0)
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, **kw)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, **kw).backward(dout)

    out = {"backend_fwd": sdpa_backend(fwd), "backend_fb": sdpa_backend(fwd_bwd)}
    f, fb = [], []
    for _ in range(runs):
        f.append(time_steps(fwd, 3, iters))
        fb.append(time_steps(fwd_bwd, 3, iters))
    out.update(fwd_ms=statistics.median(f), fb_ms=statistics.median(fb), fwd_runs=f, fb_runs=fb)
    return out


def attention_grid(args):
    with open(args.cells) as f:
        cells = json.load(f)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "device": torch.cuda.get_device_name()}), flush=True)
    for c in cells:
        out = {k: c.get(k) for k in ("key", "b", "h", "hkv", "t", "d", "causal")}
        out.update(fwd_ms=None, fb_ms=None)
        try:
            out.update(attention_cell(c, args.runs, args.iters))
        except Exception as e:  # noqa: BLE001 - every failure is reported, never fatal
            out["error"] = short(e)
        free("cuda")
        print(json.dumps(out), flush=True)


def main(argv):
    p = argparse.ArgumentParser(description="PyTorch peers of gpush's benchmarks")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpt", help="one GPT training step in eager (and torch.compile)")
    for k, v in dict(n_embd=128, n_layer=4, n_head=4, block=64, batch=16, vocab=51).items():
        g.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--compile", action="store_true")
    g.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm (0: no clipping)")
    at = sub.add_parser("attention", help="SDPA forward and forward+backward, bf16, causal")
    for k, v in dict(batch=4, heads=16, seq=4096, head_dim=64).items():
        at.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ag = sub.add_parser("attention-grid", help="SDPA forward and forward+backward over a list of cells, JSON lines out")
    ag.add_argument("--cells", required=True, help="a JSON file: a list of {key, b, h, hkv, t, d, causal}")
    ag.add_argument("--runs", type=int, default=3, help="runs a cell (the median is reported)")
    ag.add_argument("--iters", type=int, default=20, help="timed iterations a run")
    r = sub.add_parser("run", help="the cases of one workload, JSON lines out")
    r.add_argument("workload", choices=sorted(list(WORKLOADS) + list(HOST_TIMED)))
    r.add_argument("--cases", required=True, help="a JSON file: a list of cases")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "gpt":
        gpt(args)
    elif args.cmd == "attention":
        attention(args)
    elif args.cmd == "attention-grid":
        attention_grid(args)
    else:
        run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
