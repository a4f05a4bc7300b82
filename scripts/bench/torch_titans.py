#!/usr/bin/env python3
"""torch_titans.py: the PyTorch peer of scripts/bench/titans.lua: the same
chunked Titans memory update (gp.titans.memory_scan) at the same sizes, in
f32, timed forward (no grad) and forward + backward. Prints one JSON line per
memory kind: {"kind", "fwd_ms", "fwdbwd_ms"}.

Per chunk of b tokens (eta, alpha constant inside a chunk, as in the model):
  y = M0(q); u_t = -theta_t grad ||M0(k_t) - v_t||^2 = l_t r_t^T
  S_b = p1 S_0 + sum_t w_t u_t,  M_b = p2 M_0 + p3 S_0 + sum_t c_t u_t
with w_t = eta^(b-t), c_t = sum_{j=0..b-t} (1-alpha)^(b-t-j) eta^j (closed forms
of the scan that gpush's titans_coef kernel runs), p = (eta^b, (1-alpha)^b, eta c_1).

  python3 scripts/bench/torch_titans.py --batch 4 --heads 8 --seq 4096 --head-dim 40 --chunk 512
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402  (its timing loop)


def geom(r, n):
    # sum_{j<n} r^j for r in (0, 1], stable near r = 1
    near = (1 - r).abs() < 1e-4
    return torch.where(near, n.to(r.dtype), (1 - r.pow(n)) / (1 - r).clamp_min(1e-30))


def chunk_weights(eta, alpha, b):
    # eta, alpha (N, nc): per chunk; returns w, c (N, nc, b), p (N, nc, 3)
    beta = 1 - alpha
    m = torch.arange(b - 1, -1, -1, device=eta.device, dtype=eta.dtype)  # b - t for t = 1..b (0-based: b-1-s)
    e, bb = eta.unsqueeze(-1), beta.unsqueeze(-1)
    w = e.pow(m)
    hi, lo = torch.maximum(e, bb), torch.minimum(e, bb)
    c = hi.pow(m) * geom(lo / hi, m + 1)
    p = torch.stack([eta.pow(b), beta.pow(b), eta * c[..., 0]], -1)
    return w, c, p


def memory_scan(kind, init, k, v, q, theta, eta, alpha, b):
    N, T, d = k.shape
    nc = T // b
    w, c, p = chunk_weights(eta, alpha, b)
    st = dict(init)
    for n in list(init):
        st['S_' + n] = torch.zeros_like(init[n])
    ys = []
    for j in range(nc):
        sl = slice(j * b, (j + 1) * b)
        kj, vj, qj = k[:, sl], v[:, sl], q[:, sl]
        th = theta[:, sl].unsqueeze(-1) * -2
        if kind == 'linear':
            ys.append(qj @ st['M'].transpose(1, 2))
            err = kj @ st['M'].transpose(1, 2) - vj
            f = {'M': (err * th, kj)}
        else:
            W1, W2 = st['W1'], st['W2']
            ys.append(F.silu(qj @ W1.transpose(1, 2)) @ W2.transpose(1, 2))
            z = kj @ W1.transpose(1, 2)
            a = F.silu(z)
            go = (a @ W2.transpose(1, 2) - vj) * th
            s = torch.sigmoid(z)
            gz = (go @ W2) * (s * (1 + z * (1 - s)))
            f = {'W1': (gz, kj), 'W2': (go, a)}
        wj, cj = w[:, j].unsqueeze(-1), c[:, j].unsqueeze(-1)
        p1, p2, p3 = (p[:, j, i].view(N, 1, 1) for i in range(3))
        nst = {}
        for n, (l, r) in f.items():
            S0, M0 = st['S_' + n], st[n]
            nst['S_' + n] = S0 * p1 + (l * wj).transpose(1, 2) @ r
            nst[n] = M0 * p2 + S0 * p3 + (l * cj).transpose(1, 2) @ r
        st = nst
    return torch.cat(ys, 1), st


def make_inputs(kind, N, T, d, h, b, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, device=dev, generator=g)
    k = F.normalize(rn(N, T, d), dim=-1)
    q = F.normalize(rn(N, T, d), dim=-1)
    v = rn(N, T, d)
    theta = torch.rand(N, T, device=dev, generator=g) * 0.2
    eta = torch.rand(N, T // b, device=dev, generator=g) * 0.5 + 0.45
    alpha = torch.rand(N, T // b, device=dev, generator=g) * 0.05
    init = {'M': rn(N, d, d) * d ** -0.5} if kind == 'linear' else \
        {'W1': rn(N, h, d) * d ** -0.5, 'W2': rn(N, d, h) * h ** -0.5}
    for t in [k, q, v, theta, eta, alpha] + list(init.values()):
        t.requires_grad_(True)
    return init, k, v, q, theta, eta, alpha


def make_steps(kind, N, T, d, h, b, dev, compiled=False):
    """fwd() (no grad) and fwdbwd() of the memory update over one sequence"""
    init, k, v, q, theta, eta, alpha = make_inputs(kind, N, T, d, h, b, dev)
    fn = torch.compile(memory_scan) if compiled else memory_scan

    def fwd():
        with torch.no_grad():
            fn(kind, init, k, v, q, theta, eta, alpha, b)

    def fwdbwd():
        y, st = fn(kind, init, k, v, q, theta, eta, alpha, b)
        loss = y.square().sum()
        for n in init:
            loss = loss + st[n].square().sum()
        loss.backward()
        for t in [k, q, v, theta, eta, alpha] + list(init.values()):
            t.grad = None

    return fwd, fwdbwd


def time_ms(fn):
    return torch_peer.time_steps(fn, warmup=3, iters=20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--batch', type=int, default=4)
    ap.add_argument('--heads', type=int, default=8)
    ap.add_argument('--seq', type=int, default=4096)
    ap.add_argument('--head-dim', type=int, default=40)
    ap.add_argument('--hidden', type=int, default=0, help='MLP memory hidden size (default 4 head-dim)')
    ap.add_argument('--chunk', type=int, default=512)
    ap.add_argument('--kind', default='both', help='linear, mlp or both')
    ap.add_argument('--compile', action='store_true', help='torch.compile the scan')
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit('torch_titans: no CUDA GPU')
    N, h = a.batch * a.heads, a.hidden or 4 * a.head_dim
    for kind in (['linear', 'mlp'] if a.kind == 'both' else [a.kind]):
        fwd, fwdbwd = make_steps(kind, N, a.seq, a.head_dim, h, a.chunk, 'cuda', a.compile)
        print(json.dumps({'kind': kind, 'fwd_ms': time_ms(fwd), 'fwdbwd_ms': time_ms(fwdbwd),
                          'compile': a.compile}), flush=True)


if __name__ == '__main__':
    main()
