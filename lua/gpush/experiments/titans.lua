-- gp.titans: the Titans neural long-term memory (Behrouz et al., 2024, arXiv
-- 2501.00663, eqs. 11-18) and the memory-as-context (MAC) model, with a
-- sliding-window-attention baseline of the same size.
--
-- The memory update (per memory: one per batch row and head):
--   loss      l(M; x_t) = ||M(k_t) - v_t||^2
--   surprise  S_t = eta_t S_{t-1} - theta_t grad l(M'; x_t)
--   forget    M_t = (1 - alpha_t) M_{t-1} + S_t
-- Chunked parallel form (the paper's section 3.2): inside a chunk of b tokens
-- every gradient is taken at M' = the chunk's starting weights M_0, so the
-- per-token gradients are matrix products over the chunk, and each is an
-- outer product u_t = l_t r_t^T (linear memory: l = -2 theta (M_0 k - v),
-- r = k). The recurrence over the chunk is linear, so its end state is
--   S_b = p1 S_0 + sum_t w_t u_t,   M_b = p2 M_0 + p3 S_0 + sum_t c_t u_t
-- whose weights w, c, p one fused kernel scans for (gp.titans_coef: every
-- chunk of the sequence in one launch, analytic reverse scan for its
-- backward); the sums are one batched matmul each ((l * w)^T r). No per-token
-- weights are materialized and nothing is read on the host.
-- Retrieval: token t of chunk j reads M_0 of chunk j (the state after the
-- chunks before it): y_t = M_0(q_t). With chunk size 1 this is the token-by-
-- token recurrence read before its write (y_t = M_{t-1}(q_t)).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn'
local raise, is_tensor, shape_str = rt.raise, tensor.is_tensor, tensor.shape_str

local T = {}

local function need_int(op, name, v, min)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < (min or 1) then
    raise(string.format('%s: %s must be an integer >= %d, got %s', op, name, min or 1, tostring(v)))
  end
end

-- derivative of silu from differentiable ops (the outer loss differentiates through it)
local function dsilu(z)
  local s = z:sigmoid()
  return s * (z * (1 - s) + 1)
end

-- x / ||x|| over the last dim. In f32, bf16 and f16 it is RMSNorm's kernel
-- (one launch forward, one backward): x / sqrt(sum x^2 + eps) =
-- rms_norm(x, eps / D) / sqrt(D), the 1 / sqrt(D) as its weight; f64 keeps
-- the composition (rms_norm saves its scale in f32)
local unit_w = {} -- the constant weights by size, dtype and device (kept: a captured step reuses its eager step's)
function T.l2norm(x, eps)
  eps = eps or 1e-6
  if x.dtype == 'f64' then return x * ((x * x):sum(-1, {keepdim = true}) + eps):rsqrt() end
  local D = x:size(-1)
  local key = D .. x.dtype .. x.device
  local w = unit_w[key]
  if not w then
    w = gp.full({D}, 1 / math.sqrt(D), {dtype = x.dtype, device = x.device})
    unit_w[key] = w
  end
  return (gp.rms_norm(x, w, eps / D))
end

-- read the memory state at queries q (N, L, d)
local function retrieve(kind, st, q)
  if kind == 'linear' then return gp.matmul(q, st.M, {trans_b = true}) end
  local h = gp.matmul(q, st.W1, {trans_b = true}):silu()
  return gp.matmul(h, st.W2, {trans_b = true})
end

-- the surprise factors of one chunk: {name = {left (N, L, r), right (N, L, c)}}
-- with u_t[name] = left_t right_t^T = -theta_t d l(state; k_t, v_t) / d name
local function factors(kind, st, k, v, theta)
  local th = theta:unsqueeze(3) * -2
  if kind == 'linear' then
    local err = gp.matmul(k, st.M, {trans_b = true}) - v
    return {M = {err * th, k}}
  end
  local z = gp.matmul(k, st.W1, {trans_b = true}) -- (N, L, h)
  local a = z:silu()
  local err = gp.matmul(a, st.W2, {trans_b = true}) - v -- (N, L, d)
  local go = err * th -- -theta dl/do
  local gz = gp.matmul(go, st.W2) * dsilu(z) -- -theta dl/dz
  return {W1 = {gz, k}, W2 = {go, a}}
end

T.NAMES = {linear = {'M'}, mlp = {'W1', 'W2'}}

-- the chunked memory over a sequence.
--   o.kind: 'linear' (M (N, d, d)) or 'mlp' (W1 (N, h, d), W2 (N, d, h))
--   o.init: {M=} or {W1=, W2=} the starting weights; o.momentum: the starting
--           S of each (default zeros)
--   o.k, o.v, o.q: (N, T, d); o.theta, o.eta, o.alpha: (N, T) per-token gates
--   o.chunk: the chunk size b (T need not be a multiple)
--   o.fused: false keeps the linear memory on the chunk loop of products below
--            (by default a sequence of whole chunks runs as gp.titans_scan:
--            one kernel forward, two backward, state head dims up to 64 on the GPU)
-- Returns y (N, T, d) (token t read from the state at the start of its chunk)
-- and the final state {M=, S_M=} / {W1=, W2=, S_W1=, S_W2=}.
function T.memory_scan(o)
  local kind = o.kind or 'linear'
  local names = T.NAMES[kind]
  if not names then raise("memory_scan: kind must be 'linear' or 'mlp', got " .. tostring(kind)) end
  local k, v, q = o.k, o.v, o.q
  for _, nt in ipairs {{'k', k}, {'v', v}, {'q', q}} do
    if not is_tensor(nt[2]) or nt[2]:dim() ~= 3 then
      raise(string.format('memory_scan: %s must be a (N, T, d) tensor, got %s', nt[1],
        is_tensor(nt[2]) and shape_str(nt[2].shape) or type(nt[2])))
    end
  end
  local N, Tn = k:size(1), k:size(2)
  if v:size(1) ~= N or v:size(2) ~= Tn or q:size(1) ~= N or q:size(2) ~= Tn or q:size(3) ~= k:size(3) then
    raise(string.format('memory_scan: k %s, v %s and q %s must agree in N and T (and q, k in d)', shape_str(k.shape),
      shape_str(v.shape), shape_str(q.shape)))
  end
  for _, g in ipairs {'theta', 'eta', 'alpha'} do
    local t = o[g]
    if not is_tensor(t) or t:dim() ~= 2 or t:size(1) ~= N or t:size(2) ~= Tn then
      raise(string.format('memory_scan: %s must be (%d, %d), got %s', g, N, Tn,
        is_tensor(t) and shape_str(t.shape) or type(t)))
    end
  end
  local b = o.chunk or 1
  need_int('memory_scan', 'chunk', b)
  local st = {}
  for _, n in ipairs(names) do
    local w = o.init and o.init[n]
    if not is_tensor(w) or w:dim() ~= 3 or w:size(1) ~= N then
      raise(string.format('memory_scan: init.%s must be a (%d, r, c) tensor, got %s', n, N,
        is_tensor(w) and shape_str(w.shape) or type(w)))
    end
    st[n] = w
    st['S_' .. n] = o.momentum and o.momentum[n] or gp.zeros(w.shape, {dtype = w.dtype, device = w.device})
  end
  -- the weights of every chunk in one launch (full chunks) and one for a tail
  local nf = math.floor(Tn / b)
  local tail = Tn - nf * b
  local cw, cc, cp
  if nf > 0 then
    local full = function(t) return t:narrow(2, 1, nf * b):reshape {N * nf, b} end
    local w, c, p = gp.titans_coef(full(o.eta), full(o.alpha))
    cw, cc, cp = w:view {N, nf, b}, c:view {N, nf, b}, p:view {N, nf, 3}
  end
  local tw, tc, tp
  if tail > 0 then tw, tc, tp = gp.titans_coef(o.eta:narrow(2, nf * b + 1, tail), o.alpha:narrow(2, nf * b + 1, tail)) end
  -- the linear memory without a tail: every chunk in one kernel (gp.titans_scan) unless o.fused == false
  if kind == 'linear' and tail == 0 and o.fused ~= false and (k.device == 'cpu' or k:size(3) <= 64) then
    local y, M, S = gp.titans_scan(k, v, q, o.theta, cw:view {N, Tn}, cc:view {N, Tn}, cp, st.M, st.S_M)
    return y, {M = M, S_M = S}
  end
  local ys = {}
  local nch = nf + (tail > 0 and 1 or 0)
  for j = 1, nch do
    local t0, L = (j - 1) * b + 1, j <= nf and b or tail
    local kj, vj, qj, thj = k:narrow(2, t0, L), v:narrow(2, t0, L), q:narrow(2, t0, L), o.theta:narrow(2, t0, L)
    ys[j] = retrieve(kind, st, qj)
    local w, c, p
    if j <= nf then w, c, p = cw:select(2, j), cc:select(2, j), cp:select(2, j) else w, c, p = tw, tc, tp end
    w, c = w:unsqueeze(3), c:unsqueeze(3)
    local p1, p2, p3 = p:narrow(2, 1, 1):unsqueeze(3), p:narrow(2, 2, 1):unsqueeze(3), p:narrow(2, 3, 1):unsqueeze(3)
    local f = factors(kind, st, kj, vj, thj)
    local nst = {}
    for _, n in ipairs(names) do
      local l, r = f[n][1], f[n][2]
      local S0, M0 = st['S_' .. n], st[n]
      nst['S_' .. n] = S0 * p1 + gp.matmul(l * w, r, {trans_a = true})
      nst[n] = M0 * p2 + S0 * p3 + gp.matmul(l * c, r, {trans_a = true})
    end
    st = nst
  end
  return nch == 1 and ys[1] or gp.cat(ys, 2), st
end

---------------------------------------------------------------------------
-- modules

local Linear, Module = nn.Linear, nn.Module

-- nn.NeuralMemory{dim=, heads=, chunk=, kind='linear'|'mlp', hidden=4*head_dim, conv=false}
-- x (B, T, dim) -> the retrieval (B, T, dim): token t reads the memory after
-- the chunks before its own; the memory learns every chunk of x. T must be a
-- multiple of chunk. Memory math in f32 whatever the dtype of x.
local NeuralMemory = Module:extend('NeuralMemory')
T.NeuralMemory = NeuralMemory
function NeuralMemory:init(cfg)
  cfg = cfg or {}
  need_int('NeuralMemory', 'dim', cfg.dim)
  local C, H = cfg.dim, cfg.heads or 1
  need_int('NeuralMemory', 'heads', H)
  if C % H ~= 0 then raise(string.format('NeuralMemory: dim %d is not a multiple of heads %d', C, H)) end
  self.dim, self.heads, self.head_dim = C, H, C / H
  self.chunk = cfg.chunk or 64
  need_int('NeuralMemory', 'chunk', self.chunk)
  self.kind = cfg.kind or 'linear'
  if not T.NAMES[self.kind] then raise("NeuralMemory: kind must be 'linear' or 'mlp', got " .. tostring(self.kind)) end
  local o = {dtype = cfg.dtype, device = cfg.device}
  local d = self.head_dim
  self.wk = Linear(C, C, {bias = false, dtype = o.dtype, device = o.device})
  self.wv = Linear(C, C, {bias = false, dtype = o.dtype, device = o.device})
  self.wq = Linear(C, C, {bias = false, dtype = o.dtype, device = o.device})
  self.gates = Linear(C, 3 * H, o) -- theta (per token), eta and alpha (per chunk: the chunk mean of x)
  nn.init.zeros_(self.gates.weight)
  local bias = {}
  for h = 1, H do bias[h], bias[H + h], bias[2 * H + h] = -2, 2, -4 end -- theta 0.12/chunk, eta 0.88, 0.018 forgotten per chunk
  local gb = self.gates.bias
  gp.no_grad(function() gb:copy_(gp.tensor(bias, {dtype = gb.dtype, device = gb.device})) end)
  self.out = Linear(C, C, {bias = false, dtype = o.dtype, device = o.device})
  if cfg.conv then
    self.conv_k = nn.Parameter(nn.init.normal_(gp.empty({4, C}, {dtype = o.dtype or 'f32', device = o.device or gp.device()}), 0, 0.1))
    self.conv_v = nn.Parameter(nn.init.normal_(gp.empty({4, C}, {dtype = o.dtype or 'f32', device = o.device or gp.device()}), 0, 0.1))
    self.conv_q = nn.Parameter(nn.init.normal_(gp.empty({4, C}, {dtype = o.dtype or 'f32', device = o.device or gp.device()}), 0, 0.1))
    for _, w in ipairs {self.conv_k, self.conv_v, self.conv_q} do gp.no_grad(function() w:narrow(1, 4, 1):add_(1) end) end
  end
  local to = {dtype = o.dtype or 'f32', device = o.device or gp.device()}
  if self.kind == 'linear' then
    self.M0 = nn.Parameter(nn.init.normal_(gp.empty({H, d, d}, to), 0, 1 / math.sqrt(d)))
  else
    local hid = cfg.hidden or 4 * d
    self.hidden = hid
    self.W1_0 = nn.Parameter(nn.init.normal_(gp.empty({H, hid, d}, to), 0, 1 / math.sqrt(d)))
    self.W2_0 = nn.Parameter(nn.init.normal_(gp.empty({H, d, hid}, to), 0, 1 / math.sqrt(hid)))
  end
end

-- theta (B*H, T), eta and alpha (B*H, T) constant per chunk: sigmoids of linear maps of x (eta, alpha: of the
-- chunk mean, which is the chunk mean of the maps: they are affine), computed in mdt (gp.titans_gates: one kernel
-- each way). Scaled to the chunk size b: all b gradients of a chunk are taken at its starting weights, so its summed
-- step grows with b (theta = sigmoid / b keeps the memory from diverging across chunks), and alpha is the per-token
-- rate at which a chunk forgets sigmoid(.).
function NeuralMemory:gate_values(x, mdt)
  local B, Tn, H = x:size(1), x:size(2), self.heads
  local th, eta, alpha = gp.titans_gates(self.gates(x):to(mdt):view {B, Tn, 3, H}, self.chunk)
  return th:view {B * H, Tn}, eta:view {B * H, Tn}, alpha:view {B * H, Tn}
end
function NeuralMemory:init_state(B, dt)
  local st = {}
  local H = self.heads
  local function rep(w) return w:unsqueeze(1):expand {B, H, w:size(2), w:size(3)}:reshape {B * H, w:size(2), w:size(3)} end
  if self.kind == 'linear' then st.M = rep(self.M0) else st.W1, st.W2 = rep(self.W1_0), rep(self.W2_0) end
  for k, w in pairs(st) do st[k] = w:to(dt) end
  return st
end
function NeuralMemory:forward(x)
  if not is_tensor(x) or x:dim() ~= 3 or x:size(3) ~= self.dim then
    raise(string.format('NeuralMemory: x must be (B, T, %d), got %s', self.dim,
      is_tensor(x) and shape_str(x.shape) or type(x)))
  end
  local B, Tn = x:size(1), x:size(2)
  if Tn % self.chunk ~= 0 then
    raise(string.format('NeuralMemory: T = %d is not a multiple of the chunk size %d (x is %s)', Tn, self.chunk,
      shape_str(x.shape)))
  end
  local dt = x.dtype
  local mdt = dt == 'f64' and 'f64' or 'f32' -- the memory's dtype
  -- k, v, q: silu of the projections (after the causal convolution), k and q L2-normalized, per memory (B*H, T, d)
  local H, d = self.heads, self.head_dim
  local function proj(lin, conv, norm)
    local y = lin(x)
    if conv then y = gp.causal_conv1d(y, conv) end -- causal depthwise, width 4
    return gp.titans_prep(y:to(mdt):view {B, Tn, H, d}, norm):view {B * H, Tn, d}
  end
  local k = proj(self.wk, self.conv_k, true)
  local v = proj(self.wv, self.conv_v, false)
  local q = proj(self.wq, self.conv_q, true)
  local theta, eta, alpha = self:gate_values(x, mdt)
  local y = T.memory_scan {kind = self.kind, init = self:init_state(B, mdt), k = k, v = v, q = q, theta = theta, eta = eta,
                           alpha = alpha, chunk = self.chunk}
  -- back to (B, T, dim) in x's dtype: one copy (the transpose and the conversion together)
  return self.out(y:view {B, H, Tn, d}:transpose(2, 3):to(dt):reshape {B, Tn, self.dim})
end
function NeuralMemory:extra_repr()
  return string.format('dim=%d, heads=%d, chunk=%d, kind=%s', self.dim, self.heads, self.chunk, self.kind)
end

-- attention on (B', H, L, d) through flash attention; a head dim the kernels
-- do not take is zero-padded up to the next one they do, at least 64 (the
-- tensor-core kernels; scores and outputs unchanged)
local MAX_PAD = 256
function T.attend(q, k, v, opts)
  local d = q:size(4)
  local pd = math.max(d, 64)
  while pd <= MAX_PAD and not gp.attention_supported('fwd', q.dtype, pd) do pd = pd + 1 end
  if pd > MAX_PAD then raise(string.format('titans: no attention kernel takes head dim %d or more (q is %s)', d, shape_str(q.shape))) end
  local o = {causal = true, scale = 1 / math.sqrt(d), window = opts and opts.window or 0, n_global = opts and opts.n_global or 0}
  if pd == d then return (gp.attention(q, k, v, o)) end
  local function pad(t)
    local s = t.shape
    s[4] = pd - d
    return gp.cat({t, gp.zeros(s, {dtype = t.dtype, device = t.device})}, 4)
  end
  return (gp.attention(pad(q), pad(k), pad(v), o)):narrow(4, 1, d)
end

-- q, k, v (B', H, L, hd) from one product; with rope ({inv_freq =, pos = {}}: TitansLM's), q and k turned by
-- rotary embeddings at positions 0 .. L-1 (a device tensor made once per length and kept in rope.pos[L])
local function mha_qkv(lin, x, H, rope)
  local Bp, L, C = x:size(1), x:size(2), x:size(3)
  local qkv = lin(x)
  local hd = C / H
  local pos = rope and rope.pos[L]
  if rope and not pos then pos = gp.arange(L, {dtype = 'i32', device = x.device}); rope.pos[L] = pos end
  local function head(i)
    local t = qkv:narrow(3, (i - 1) * C + 1, C):reshape {Bp, L, H, hd}
    if rope and i < 3 then t = gp.rope(t, pos, rope.inv_freq) end
    return t:transpose(2, 3)
  end
  return head(1), head(2), head(3)
end
local function merge(y)
  local Bp, H, L, hd = y:size(1), y:size(2), y:size(3), y:size(4)
  return y:transpose(2, 3):reshape {Bp, L, H * hd}
end

-- nn.MACBlock{dim=, heads=, chunk=, persistent=4, memory='linear'|'mlp', conv=true}:
-- per segment of `chunk` tokens: h = memory retrieval (state after the
-- segments before), causal attention over [persistent || h_1 x_1 h_2 x_2 ...]
-- (h_t interleaved before x_t, so token t sees the retrievals of tokens <= t
-- only), the attention output at the x positions gated by sigmoid(W h), then
-- an MLP. The memory learns the segment (its keys and values come from the
-- block's input), so every segment's attention runs in one batched call.
local MACBlock = Module:extend('MACBlock')
T.MACBlock = MACBlock
function MACBlock:init(cfg)
  local C, H = cfg.dim, cfg.heads
  local o = {dtype = cfg.dtype, device = cfg.device}
  self.dim, self.heads, self.chunk, self.n_persistent = C, H, cfg.chunk, cfg.persistent or 4
  self.ln_m = nn.RMSNorm(C, o)
  self.memory = NeuralMemory {dim = C, heads = cfg.mem_heads or H, chunk = cfg.chunk, kind = cfg.memory or 'linear',
                              conv = cfg.conv ~= false, dtype = cfg.dtype, device = cfg.device}
  self.ln1 = nn.RMSNorm(C, o)
  self.qkv = Linear(C, 3 * C, {bias = false, dtype = o.dtype, device = o.device})
  self.proj = Linear(C, C, {bias = false, dtype = o.dtype, device = o.device})
  self.gate = Linear(C, C, o)
  self.persistent = nn.Parameter(nn.init.normal_(gp.empty({self.n_persistent, C}, {dtype = o.dtype or 'f32',
                                                                                   device = o.device or gp.device()}), 0, 0.02))
  self.ln2 = nn.RMSNorm(C, o)
  self.mlp = nn.MLP(C, 4 * C, o)
end
function MACBlock:forward(x, rope)
  local B, Tn, C = x:size(1), x:size(2), x:size(3)
  local b, Np = self.chunk, self.n_persistent
  local ns = Tn / b
  local h = self.memory(self.ln_m(x))
  local xn = self.ln1(x)
  local z = gp.stack({h:to(xn.dtype), xn}, 3):reshape {B * ns, 2 * b, C}
  local P = self.persistent:to(xn.dtype):unsqueeze(1):expand {B * ns, Np, C}
  local q, k, v = mha_qkv(self.qkv, gp.cat({P, z}, 2), self.heads, rope)
  local y = merge(T.attend(q, k, v)) -- (B*ns, Np + 2b, C)
  y = y:narrow(2, Np + 1, 2 * b):reshape {B * ns, b, 2, C}:select(3, 2):reshape {B, Tn, C}
  x = x + self.proj(y) * self.gate(h):sigmoid()
  return x + self.mlp(self.ln2(x))
end

-- nn.SWABlock{dim=, heads=, window=, mlp_hidden=4 dim}: pre-norm block with causal
-- sliding-window attention (window 0: full causal attention)
local SWABlock = Module:extend('SWABlock')
T.SWABlock = SWABlock
function SWABlock:init(cfg)
  local C, o = cfg.dim, {dtype = cfg.dtype, device = cfg.device}
  self.heads, self.window = cfg.heads, cfg.window
  self.ln1 = nn.RMSNorm(C, o)
  self.qkv = Linear(C, 3 * C, {bias = false, dtype = o.dtype, device = o.device})
  self.proj = Linear(C, C, {bias = false, dtype = o.dtype, device = o.device})
  self.ln2 = nn.RMSNorm(C, o)
  self.mlp = nn.MLP(C, cfg.mlp_hidden or 4 * C, o)
end
function SWABlock:forward(x, rope)
  local q, k, v = mha_qkv(self.qkv, self.ln1(x), self.heads, rope)
  x = x + self.proj(merge(T.attend(q, k, v, {window = self.window})))
  return x + self.mlp(self.ln2(x))
end

-- nn.TitansLM{model='mac'|'swa'|'full', vocab_size=256, seq_len=, dim=, num_layers=, num_heads=, chunk=,
--             persistent=4, memory='linear'|'mlp', window=chunk, mlp_hidden=4 dim, pos='learned'|'rope'}: byte LM;
--             model(idx) -> logits, model(idx, targets) -> logits, loss
-- The SWA model's window is the chunk size (the span MAC's attention sees)
-- unless window= is given; 'full' is causal attention over the whole sequence
-- (the upper baseline). mlp_hidden (SWA and full only) widens their MLPs, to
-- match MAC's parameter count (gp.titans.matched_hidden). pos = 'rope' turns
-- q and k of every attention by rotary embeddings (positions within the
-- attention's own sequence: a MAC segment with its persistent tokens) in place
-- of the learned position table, so attention sees relative positions only.
local TitansLM = Module:extend('TitansLM')
T.TitansLM = TitansLM
function TitansLM:init(cfg)
  cfg = cfg or {}
  for _, k in ipairs {'seq_len', 'dim', 'num_layers', 'num_heads', 'chunk'} do need_int('TitansLM', k, cfg[k]) end
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.model = c.model or 'mac'
  c.vocab_size = c.vocab_size or 256
  if c.model ~= 'mac' and c.model ~= 'swa' and c.model ~= 'full' then
    raise("TitansLM: model must be 'mac', 'swa' or 'full', got " .. tostring(c.model))
  end
  if c.window ~= nil then need_int('TitansLM', 'window', c.window) end
  if c.dim % c.num_heads ~= 0 then raise(string.format('TitansLM: dim %d is not a multiple of num_heads %d', c.dim, c.num_heads)) end
  if c.seq_len % c.chunk ~= 0 then raise(string.format('TitansLM: seq_len %d is not a multiple of the chunk size %d', c.seq_len, c.chunk)) end
  self.config = c
  local o = {dtype = c.dtype, device = c.device}
  c.pos = c.pos or 'learned'
  if c.pos ~= 'learned' and c.pos ~= 'rope' then raise("TitansLM: pos must be 'learned' or 'rope', got " .. tostring(c.pos)) end
  self.wte = nn.Embedding(c.vocab_size, c.dim, o)
  if c.pos == 'learned' then
    self.wpe = nn.Embedding(c.seq_len, c.dim, o)
  else
    if (c.dim / c.num_heads) % 2 ~= 0 then raise(string.format('TitansLM: pos = rope needs an even head dim, got %d', c.dim / c.num_heads)) end
    rawset(self, '_rope', {}) -- per device {inv_freq =, pos = {[L] = positions}}, not saved
  end
  local blocks = {}
  for i = 1, c.num_layers do
    local bc = {dim = c.dim, heads = c.num_heads, chunk = c.chunk, window = c.model == 'full' and 0 or (c.window or c.chunk),
                persistent = c.persistent, memory = c.memory, mem_heads = c.mem_heads, conv = c.conv, dtype = c.dtype,
                device = c.device, mlp_hidden = c.model ~= 'mac' and c.mlp_hidden or nil}
    blocks[i] = c.model == 'mac' and MACBlock(bc) or SWABlock(bc)
  end
  self.h = blocks
  self.ln_f = nn.RMSNorm(c.dim, o)
  self.lm_head = Linear(c.dim, c.vocab_size, {bias = false, dtype = c.dtype, device = c.device})
  nn.init.normal_(self.wte.weight, 0, 0.02)
  if self.wpe then nn.init.normal_(self.wpe.weight, 0, 0.02) end
end
function TitansLM:forward(idx, targets, opts)
  local Tn = idx:size(2)
  if Tn > self.config.seq_len or Tn % self.config.chunk ~= 0 then
    raise(string.format('TitansLM: %d tokens; at most seq_len %d and a multiple of the chunk size %d', Tn,
      self.config.seq_len, self.config.chunk))
  end
  local x, rope = self.wte(idx), nil
  if self.wpe then
    local pos = rawget(self, '_pos')
    if not pos or pos:size(1) ~= Tn or pos.device ~= idx.device then
      pos = gp.arange(Tn, {device = idx.device}); rawset(self, '_pos', pos)
    end
    x = x + self.wpe(pos)
  else
    local per_device = rawget(self, '_rope')
    rope = per_device[idx.device]
    if not rope then
      rope = {inv_freq = gp.rope_inv_freq(self.config.dim / self.config.num_heads, {device = idx.device}), pos = {}}
      per_device[idx.device] = rope
    end
  end
  for _, blk in ipairs(self.h) do x = blk(x, rope) end
  local logits = self.lm_head(self.ln_f(x))
  if targets ~= nil then return logits, gp.cross_entropy(logits, targets, opts) end
  return logits
end
function TitansLM:extra_repr()
  local c = self.config
  return string.format('model=%s, dim=%d, num_layers=%d, num_heads=%d, chunk=%d, seq_len=%d, pos=%s', c.model, c.dim,
    c.num_layers, c.num_heads, c.chunk, c.seq_len, c.pos)
end

-- the MLP hidden size that gives an SWA or full-attention TitansLM of cfg
-- (about) the parameter count of the MAC model of the same cfg: MAC's extra
-- parameters per block (memory, gate, persistent tokens) spread over the
-- MLP's two matrices and bias (2 dim + 1 per hidden unit). Returns the
-- hidden size and the two counts (MAC's, the matched model's).
function T.matched_hidden(cfg)
  local function count(c) return TitansLM(c):num_parameters() end
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.device, c.mlp_hidden = 'cpu', nil
  c.model = 'mac'
  local mac = count(c)
  c.model = 'swa'
  local plain = count(c)
  local hidden = 4 * c.dim + math.max(0, math.floor((mac - plain) / (c.num_layers * (2 * c.dim + 1)) + 0.5))
  c.mlp_hidden = hidden
  return hidden, mac, count(c)
end

local doc = gp.doc
doc(T.memory_scan, 'gp.titans.memory_scan{kind=, init=, k=, v=, q=, theta=, eta=, alpha=, chunk=, momentum=}',
  'the chunked Titans memory over (N, T, d) keys, values and queries with per-token gates (N, T): returns the ' ..
  'retrievals y (N, T, d) (each token reads the state at the start of its chunk) and the final state; differentiable')
doc(T.l2norm, 'gp.titans.l2norm(x, eps=1e-6)', 'x / sqrt(sum(x^2) + eps) over the last dim (differentiable; RMSNorm\'s kernel but in f64)')
doc(T.attend, 'gp.titans.attend(q, k, v, {window=0, n_global=0})',
  'causal flash attention on (B, H, L, d), the head dim zero-padded up to one the kernels take (at least 64)')
doc(T.NeuralMemory, "nn.NeuralMemory{dim=, heads=1, chunk=64, kind='linear'|'mlp', hidden=4*head_dim, conv=false}",
  'Titans long-term memory: x (B, T, dim) -> retrievals (B, T, dim); SiLU k, v, q (k, q L2-normalized), ' ..
  'theta per token, eta and alpha per chunk (sigmoids of linear maps), chunked updates (gp.titans.memory_scan)')
doc(T.MACBlock, "nn.MACBlock{dim=, heads=, chunk=, persistent=4, memory='linear', mem_heads=heads, conv=true}",
  'memory-as-context block: attention per segment over [persistent || retrievals interleaved with tokens], gated by the memory')
doc(T.SWABlock, 'nn.SWABlock{dim=, heads=, window=, mlp_hidden=4 dim}', 'pre-norm block with causal sliding-window attention (window 0: full)')
doc(T.TitansLM, "nn.TitansLM{model='mac'|'swa'|'full', seq_len=, dim=, num_layers=, num_heads=, chunk=, window=chunk, mlp_hidden=, vocab_size=256, pos='learned'|'rope'}",
  'byte-level LM of MAC blocks, sliding-window blocks (window = chunk) or full causal attention, with learned or rotary positions: model(idx, targets) -> logits, loss')
doc(T.matched_hidden, 'gp.titans.matched_hidden(cfg)',
  'the MLP hidden size that gives the SWA / full TitansLM of cfg the parameter count of its MAC model: hidden, mac_params, matched_params')
return T
