"""PyTorch peer of `gpush scripts/polychromic.lua --model smollm2 --bench-step`:
the same polychromic step with transformers + peft + sentence-transformers on
the same SmolLM2 weights (a bf16 base: bitsandbytes is not installed), the
same prompts, batch and lengths, timed on the GPU.

One step, as gpush's: n replies for each of B prompts sampled in one batch
with a KV cache (temperature, top-p, stop at <|im_end|>); every reply's
reward by the same checker (a port of gp.polychromic.lm.reply_reward); the
replies' all-MiniLM-L6-v2 embeddings (sentence-transformers, normalized);
poly advantages (subsets of m = n/2 of each prompt's replies, f = mean r *
(floor + mean over pairs of r_i r_j (1 - cos)), marginal advantage, scaled by
the batch std); the PPO clipped surrogate over the reply tokens (the head on
the reply columns only, logits_to_keep), AdamW on the LoRA adapters (rank and
alpha as gpush's, every attention and MLP linear).

Generation, fastest first (--gen auto tries them in this order and says which ran):
  loop     a hand-written decode loop over a transformers StaticCache, the
           model's forward compiled with torch.compile(mode="reduce-overhead")
  compile  model.generate with cache_implementation="static" and the forward
           compiled the same way
  eager    model.generate as it comes (dynamic cache)
The update always runs eager (the compiled forward is for decode shapes).

  build/gpush scripts/polychromic.lua --model smollm2 --save-hf /tmp/smollm2-hf
  python3 scripts/bench/torch_polychromic.py --dir /tmp/smollm2-hf

Prints one JSON line: {"impl": "torch", "gen", "lora", "s_per_step",
"generation_s", "diversity_s", "update_s", "reply_tokens", ...} (medians of
--steps steps after --warmup steps)."""
import argparse
import itertools
import json
import math
import os
import random
import re
import statistics
import time

import torch
import torch.nn.functional as F
import transformers

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True, help="the directory scripts/polychromic.lua --save-hf wrote")
p.add_argument("--encoder", default="", help="the all-MiniLM-L6-v2 sentence-transformers directory "
               "(default: $GPUSH_CACHE/models/all-minilm-l6-v2, else ~/.cache/gpush/models/all-minilm-l6-v2)")
p.add_argument("--gen", default="auto", choices=["auto", "loop", "compile", "eager"])
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--seed", type=int, default=1234)
a = p.parse_args()

cfg = json.load(open(os.path.join(a.dir, "polychromic_bench.json")))
dev = "cuda"
dt = torch.bfloat16
torch.manual_seed(a.seed)
random.seed(a.seed)
N, MAX_NEW, STOP = cfg["n"], cfg["max_new"], cfg["stop"]
TEMP, TOP_P = cfg["temperature"], cfg["top_p"]
prompts = cfg["prompt_ids"]
meta = cfg["prompts"]
B = len(prompts)

# ---------------------------------------------------------------------------
# decoding: the byte-level tokens gpush wrote (GPT-2's byte alphabet), specials skipped


def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BD = byte_decoder()
TOKENS = cfg["tokens"]
SPECIAL = set(cfg["special"])


def decode(ids):
    out = bytearray()
    for i in ids:
        if i in SPECIAL or i >= len(TOKENS):
            continue
        for ch in TOKENS[i]:
            if ch in BD:
                out.append(BD[ch])
            else:
                out += ch.encode("utf-8")
    return out.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------
# the reward: gp.polychromic.lm.reply_reward


def words_of(s):
    w = []
    for x in s.split():
        k = re.sub(r"[^A-Za-z]+$", "", re.sub(r"^[^A-Za-z]+", "", x.lower()))
        if k:
            w.append(k)
    return w


def reply_reward(line, word, reply, max_words):
    w = words_of(reply)
    checks = [3 <= len(w) <= max_words]
    wl = word.lower()
    checks.append(any(x in (wl, wl + "s", wl + "'s", wl + "es") for x in w))
    lw = set(words_of(line))
    distinct = set(w)
    inline = sum(1 for x in distinct if x in lw)
    copy = (len(distinct) > 0 and inline / len(distinct) >= 0.6) or \
        (len(w) > 0 and " ".join(words_of(line)) in " ".join(w))
    checks.append(not copy)
    rep, count, tri = False, {}, set()
    for i, x in enumerate(w):
        if len(x) >= 3:
            count[x] = count.get(x, 0) + 1
            rep = rep or count[x] > 3
        if i >= 2:
            k = (w[i - 2], w[i - 1], x)
            rep = rep or k in tri
            tri.add(k)
    checks.append(not rep)
    nonspace = [c for c in reply if not c.isspace()]
    letters = sum(1 for c in nonspace if ("a" <= c <= "z") or ("A" <= c <= "Z"))
    ascii_ok = all(c in "\t\n\r" or 32 <= ord(c) <= 126 for c in reply) and "<|" not in reply
    checks.append(ascii_ok and letters > 0 and letters >= 0.7 * len(nonspace))
    passed = sum(checks)
    return 1.0 if passed == len(checks) else 0.5 * passed / len(checks)


# ---------------------------------------------------------------------------
# the model, LoRA adapters, the encoder

model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, dtype=dt).to(dev)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
try:
    import peft
    pm = peft.get_peft_model(model, peft.LoraConfig(r=cfg["rank"], lora_alpha=cfg["alpha"], lora_dropout=0.0,
                                                    target_modules=TARGETS, bias="none"))
    lora_kind = "peft " + peft.__version__
    adapters = [p_ for p_ in pm.parameters() if p_.requires_grad]
except ImportError:  # the same adapters by hand: y = W x + (alpha / r) B A x, A ~ U(+-1/sqrt(in)), B = 0
    class LoRALinear(torch.nn.Module):
        def __init__(self, lin, r, alpha):
            super().__init__()
            self.lin = lin
            k = 1 / math.sqrt(lin.in_features)
            self.A = torch.nn.Parameter(torch.empty(r, lin.in_features, device=dev, dtype=dt).uniform_(-k, k))
            self.B = torch.nn.Parameter(torch.zeros(lin.out_features, r, device=dev, dtype=dt))
            self.s = alpha / r

        def forward(self, x):
            return self.lin(x) + (x @ self.A.t() @ self.B.t()) * self.s

    for p_ in model.parameters():
        p_.requires_grad_(False)
    for name, mod in list(model.named_modules()):
        for t in TARGETS:
            if hasattr(mod, t) and isinstance(getattr(mod, t), torch.nn.Linear):
                setattr(mod, t, LoRALinear(getattr(mod, t), cfg["rank"], cfg["alpha"]))
    lora_kind = "hand-written (peft not installed)"
    adapters = [p_ for p_ in model.parameters() if p_.requires_grad]
opt = torch.optim.AdamW(adapters, lr=cfg["lr"], weight_decay=0)
eager_forward = model.forward  # the update's forward (the LoRA layers are in the model's modules)

from sentence_transformers import SentenceTransformer  # noqa: E402

enc_dir = a.encoder or os.path.join(os.environ.get("GPUSH_CACHE", os.path.expanduser("~/.cache/gpush")), "models",
                                    "all-minilm-l6-v2")
encoder = SentenceTransformer(enc_dir, device=dev)

# ---------------------------------------------------------------------------
# generation: R = B n rows, prompt-major, left-padded prompts


def sample(logits):
    x = logits.float() / TEMP
    probs = F.softmax(x, dim=-1)
    if TOP_P < 1:
        sp, si = probs.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < TOP_P
        sp = sp * keep
        nxt = si.gather(1, torch.multinomial(sp, 1))
    else:
        nxt = torch.multinomial(probs, 1)
    return nxt.squeeze(1)


Lp = max(len(x) for x in prompts)
ids0 = torch.tensor([[STOP] * (Lp - len(x)) + x for x in prompts], device=dev)
mask0 = torch.tensor([[0] * (Lp - len(x)) + [1] * len(x) for x in prompts], device=dev)
ids_r, mask_r = ids0.repeat_interleave(N, 0), mask0.repeat_interleave(N, 0)
R = B * N
CAP = Lp + MAX_NEW


def make_static_cache():
    from transformers import StaticCache
    for kw in (dict(config=model.config, max_cache_len=CAP),
               dict(config=model.config, max_batch_size=R, max_cache_len=CAP, device=dev, dtype=dt)):
        try:
            return StaticCache(**kw)
        except TypeError:
            continue
    raise RuntimeError("no StaticCache signature fits")


step_forward = None
static_cache = None


@torch.no_grad()
def gen_loop():
    # one cache for every call, reset in place (as generate keeps its static cache): the compiled step sees the
    # same buffers each time, so its CUDA graph is recorded once
    global static_cache
    if static_cache is None:
        static_cache = make_static_cache()
    else:
        static_cache.reset()
    cache = static_cache
    full_mask = torch.cat([mask_r, torch.ones(R, MAX_NEW, dtype=mask_r.dtype, device=dev)], 1)
    pos = (mask_r.cumsum(1) - 1).clamp(min=0)
    out = eager_forward(input_ids=ids_r, attention_mask=full_mask, position_ids=pos, past_key_values=cache,
                        cache_position=torch.arange(Lp, device=dev), use_cache=True, logits_to_keep=1).logits[:, -1]
    last = pos[:, -1:] + 1
    done = torch.zeros(R, dtype=torch.bool, device=dev)
    toks = []
    for t in range(MAX_NEW):
        nxt = torch.where(done, torch.full_like(done, STOP, dtype=torch.long), sample(out))
        toks.append(nxt)
        done = done | (nxt == STOP)
        if t == MAX_NEW - 1 or ((t + 1) % 16 == 0 and bool(done.all())):
            break
        out = step_forward(input_ids=nxt[:, None], attention_mask=full_mask, position_ids=last + t,
                           past_key_values=cache, cache_position=torch.tensor([Lp + t], device=dev),
                           use_cache=True).logits[:, -1].clone()
    return torch.stack(toks, 1)


@torch.no_grad()
def gen_generate():
    out = model.generate(input_ids=ids0, attention_mask=mask0, do_sample=True, temperature=TEMP, top_p=TOP_P, top_k=0,
                         max_new_tokens=MAX_NEW, num_return_sequences=N, eos_token_id=STOP, pad_token_id=STOP)
    return out[:, Lp:]


def replies_of(gen):
    ids, stopped = [], []
    for row in gen.tolist():
        r = []
        for v in row:
            if v == STOP:
                break
            r.append(v)
        ids.append(r)
        stopped.append(len(r) < MAX_NEW)
    return ids, stopped


# ---------------------------------------------------------------------------
# poly advantages (set_div pair, valid_only, floor), as gp.polychromic.advantages


def subsets(n, m, k):
    total = math.comb(n, m)
    if total <= k:
        return [list(s) for s in itertools.combinations(range(n), m)]
    seen, out = set(), []
    while len(out) < k:
        s = tuple(sorted(random.sample(range(n), m)))
        if s not in seen:
            seen.add(s)
            out.append(list(s))
    return out


def poly_advantages(rewards, emb):
    m = max(2, min(N, cfg.get("subset_size") or max(2, N // 2)))
    subs = subsets(N, m, cfg["max_subsets"])
    floor, valid_only = cfg["floor"], cfg["valid_only"]
    dist = (1 - emb.view(B, N, -1) @ emb.view(B, N, -1).transpose(1, 2)).float().cpu().tolist()
    npair = m * (m - 1) / 2
    adv = [0.0] * R
    for b in range(B):
        r = rewards[b * N:(b + 1) * N]
        fsum, contain, cnt = 0.0, [0.0] * N, [0] * N
        for s in subs:
            mr = sum(r[i] for i in s) / m
            d = 0.0
            for x in range(m):
                for y in range(x + 1, m):
                    i, j = s[x], s[y]
                    d += (r[i] * r[j] if valid_only else 1) * dist[b][i][j]
            f = mr * (floor + d / npair)
            fsum += f
            for i in s:
                contain[i] += f
                cnt[i] += 1
        mean = fsum / len(subs)
        for i in range(N):
            adv[b * N + i] = contain[i] / cnt[i] - mean if cnt[i] else 0.0
    mu = sum(adv) / R
    sd = math.sqrt(max(0.0, sum(x * x for x in adv) / R - mu * mu))
    return [x / (sd + 1e-4) for x in adv]


# ---------------------------------------------------------------------------
# one step


def step(gen):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g = gen()
    ids, stopped = replies_of(g)
    texts = [decode(r) for r in ids]
    rewards = []
    for i, t in enumerate(texts):
        mt = meta[i // N]
        rewards.append(reply_reward(mt["line"], mt["word"], t, cfg["max_words"]))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    emb = encoder.encode(texts, convert_to_tensor=True, normalize_embeddings=True, batch_size=256)
    adv = poly_advantages(rewards, emb)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    # rows prompt + reply (+ stop), right-padded; targets on the reply (and its stop) only
    rows, plens = [], []
    for i in range(R):
        pr = prompts[i // N]
        rows.append(pr + ids[i] + ([STOP] if stopped[i] else []))
        plens.append(len(pr))
    T = max(len(r) for r in rows)
    full = torch.tensor([r + [STOP] * (T - len(r)) for r in rows], device=dev)
    tgt = torch.full((R, T - 1), -100, dtype=torch.long, device=dev)
    for i, r in enumerate(rows):
        if len(r) > plens[i]:
            tgt[i, plens[i] - 1:len(r) - 1] = full[i, plens[i]:len(r)]
    frm = min(plens)  # the first scored column (1-based), as gpush's rollout
    K = T - frm
    tgt = tgt[:, frm - 1:]
    mask = (tgt != -100).float()
    at = torch.tensor(adv, device=dev).view(R, 1)
    old = None
    model.train()
    for _ in range(cfg["epochs"]):
        opt.zero_grad(set_to_none=True)
        logits = eager_forward(input_ids=full[:, :-1], logits_to_keep=K, use_cache=False).logits
        logp = -F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none",
                                ignore_index=-100).view(R, K)
        if old is None:
            old = logp.detach()
        ratio = (logp - old).exp()
        s1, s2 = ratio * at, ratio.clamp(1 - cfg["clip"], 1 + cfg["clip"]) * at
        loss = -(torch.minimum(s1, s2) * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapters, 1.0)
        opt.step()
    model.eval()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return {"s": t3 - t0, "generation_s": t1 - t0, "diversity_s": t2 - t1, "update_s": t3 - t2,
            "reply_tokens": sum(len(r) for r in ids) / R, "reward": sum(rewards) / R}


def run(kind):
    global step_forward
    if kind == "loop":
        step_forward = torch.compile(eager_forward, mode="reduce-overhead", fullgraph=False)
        return gen_loop
    if kind == "compile":
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(eager_forward, mode="reduce-overhead", fullgraph=False)
        return gen_generate
    model.generation_config.cache_implementation = None
    model.forward = eager_forward
    return gen_generate


kinds = ["loop", "compile", "eager"] if a.gen == "auto" else [a.gen]
used, recs, errors = None, [], {}
for kind in kinds:
    try:
        gen = run(kind)
        recs = [step(gen) for _ in range(a.warmup + a.steps)]
        used = kind
        break
    except Exception as e:  # noqa: BLE001  (a configuration of the stack that does not run: the next one)
        errors[kind] = f"{type(e).__name__}: {str(e)[:300]}"
        model.forward = eager_forward
        torch._dynamo.reset()
if used is None:
    raise SystemExit("no generation mode ran: " + json.dumps(errors))
timed = recs[a.warmup:]


def med(k):
    return statistics.median(r[k] for r in timed)


print(json.dumps({"impl": "torch", "gen": used, "lora": lora_kind, "base": "bf16", "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "transformers": transformers.__version__, "prompts": B, "n": N,
                  "max_new": MAX_NEW, "epochs": cfg["epochs"], "rank": cfg["rank"], "steps": a.steps,
                  "s_per_step": med("s"), "generation_s": med("generation_s"), "diversity_s": med("diversity_s"),
                  "update_s": med("update_s"), "reply_tokens": med("reply_tokens"), "reward": med("reward"),
                  "prompt_tokens": sum(len(x) for x in prompts) / B,
                  "peak_mib": torch.cuda.max_memory_allocated() / 1048576, "failed_modes": errors}), flush=True)
