-- gp.optim: AdamW and SGD against a Lua reference over several steps,
-- weight decay only on dims >= 2 (and per group), the multi-tensor list
-- cache, clip_grad_norm on the device, schedules, state_dict round trips and
-- bf16 mixed precision with f32 master weights (on the CPU backend).
local T = require 'lib'
local optim = gp.optim
local Tensor = gp.Tensor

local function flat(t) return T.flat(t) end

-- the reference: plain Lua over flat lists, in double
local function ref_adamw(p, m, v, g, h, step, decay, gs)
  local b1, b2 = h.betas[1], h.betas[2]
  local bc1, bc2 = 1 - b1 ^ step, 1 - b2 ^ step
  local wd = decay and h.weight_decay or 0
  for i = 1, #p do
    local gi = g[i] * (gs or 1)
    m[i] = b1 * m[i] + (1 - b1) * gi
    v[i] = b2 * v[i] + (1 - b2) * gi * gi
    p[i] = p[i] * (1 - h.lr * wd) - h.lr * (m[i] / bc1) / (math.sqrt(v[i] / bc2) + h.eps)
  end
end

local function ref_sgd(p, buf, g, h, decay, gs)
  local wd = decay and h.weight_decay or 0
  for i = 1, #p do
    local gi = g[i] * (gs or 1) + wd * p[i]
    buf[i] = h.momentum * buf[i] + gi
    p[i] = p[i] - h.lr * (h.nesterov and gi + h.momentum * buf[i] or buf[i])
  end
end

local function zeros(n) local z = {}; for i = 1, n do z[i] = 0 end; return z end

local function near_list(a, b, tol, what)
  T.eq(#a, #b, what)
  for i = 1, #a do T.near(a[i], b[i], tol, string.format('%s[%d]', what, i)) end
end

T.test('AdamW matches the reference over 4 steps; decay only on the matrix', function()
  local W = gp.randn({3, 5}, {device = 'cpu'}):requires_grad()
  local b = gp.randn({5}, {device = 'cpu'}):requires_grad()
  local h = {lr = 0.01, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.5}
  local opt = optim.AdamW({W, b}, h)
  local rW, rb = flat(W), flat(b)
  local mW, vW, mb, vb = zeros(15), zeros(15), zeros(5), zeros(5)
  for step = 1, 4 do
    if step == 1 then
      -- grads set as fresh tensors
      W.grad, b.grad = gp.randn({3, 5}, {device = 'cpu'}), gp.randn({5}, {device = 'cpu'})
    else
      -- grads written into the optimizer's zeroed buffers
      opt:zero_grad()
      W.grad:copy_(gp.randn({3, 5}, {device = 'cpu'}))
      b.grad:add_(gp.randn({5}, {device = 'cpu'}))
    end
    ref_adamw(rW, mW, vW, flat(W.grad), h, step, true)
    ref_adamw(rb, mb, vb, flat(b.grad), h, step, false)
    opt:step()
    near_list(flat(W), rW, 1e-5, 'W step ' .. step)
    near_list(flat(b), rb, 1e-5, 'b step ' .. step)
  end
  T.eq(opt.step_count, 4)
  near_list(flat(opt.state[1].exp_avg), mW, 1e-5, 'm')
  near_list(flat(opt.state[1].exp_avg_sq), vW, 1e-5, 'v')
end)

T.test('AdamW defaults and param groups: weight_decay=0 in a group', function()
  local A = gp.randn({4, 4}, {device = 'cpu'}):requires_grad()
  local Bm = gp.randn({4, 4}, {device = 'cpu'}):requires_grad()
  local opt = optim.AdamW({{params = {A}}, {params = {Bm}, weight_decay = 0}}, {lr = 0.1})
  T.eq(opt.param_groups[1].weight_decay, 0.1)
  T.eq(opt.param_groups[1].betas[2], 0.95)
  T.eq(opt.param_groups[1].eps, 1e-8)
  -- zero gradients: only decay moves A; B stays put
  local a0, b0 = flat(A), flat(Bm)
  opt:zero_grad()
  opt:step()
  local a1, b1 = flat(A), flat(Bm)
  for i = 1, 16 do
    T.near(a1[i], a0[i] * (1 - 0.1 * 0.1), 1e-6, 'A decays')
    T.near(b1[i], b0[i], 1e-7, 'B has no decay')
  end
  T.raises(function() optim.AdamW({A, A}) end, 'appears twice')
  T.raises(function() optim.AdamW({gp.arange(3)}) end, 'must be float')
  T.raises(function() optim.AdamW({}) end, 'no parameters')
end)

T.test('SGD with momentum, Nesterov and weight decay matches the reference', function()
  for _, nesterov in ipairs {false, true} do
    local W = gp.randn({2, 3}, {device = 'cpu'}):requires_grad()
    local b = gp.randn({3}, {device = 'cpu'}):requires_grad()
    local h = {lr = 0.05, momentum = 0.9, nesterov = nesterov, weight_decay = 0.01}
    local opt = optim.SGD({W, b}, h)
    local rW, rb, bW, bb = flat(W), flat(b), zeros(6), zeros(3)
    for step = 1, 3 do
      opt:zero_grad()
      W.grad:copy_(gp.randn({2, 3}, {device = 'cpu'}))
      b.grad:copy_(gp.randn({3}, {device = 'cpu'}))
      ref_sgd(rW, bW, flat(W.grad), h, true)
      ref_sgd(rb, bb, flat(b.grad), h, false)
      opt:step()
      near_list(flat(W), rW, 1e-5, 'W nesterov=' .. tostring(nesterov) .. ' step ' .. step)
      near_list(flat(b), rb, 1e-5, 'b nesterov=' .. tostring(nesterov) .. ' step ' .. step)
    end
  end
  T.raises(function() optim.SGD({gp.zeros {2}}, {nesterov = true}) end, 'nesterov needs momentum')
end)

T.test('the multi-tensor list is kept while the grad objects stay, re-made when one changes', function()
  local W = gp.randn({3, 3}, {device = 'cpu'}):requires_grad()
  local b = gp.randn({3}, {device = 'cpu'}):requires_grad()
  local opt = optim.AdamW({W, b}, {lr = 1e-3})
  local function lists()
    local r = {}
    for k, c in pairs(opt._lists) do r[k] = c.tl end
    return r
  end
  opt:zero_grad(); W.grad:fill_(1); b.grad:fill_(1)
  opt:step()
  local l1 = lists()
  opt:zero_grad(); W.grad:fill_(2)
  opt:step()
  local l2 = lists()
  local n = 0
  for k, tl in pairs(l1) do T.ok(l2[k] == tl, 'the same list after zero_grad'); n = n + 1 end
  T.eq(n, 2, 'two buckets: decay and no decay')
  W.grad = gp.ones({3, 3}, {device = 'cpu'})  -- a new grad object
  opt:step()
  local l3 = lists()
  local changed = 0
  for k, tl in pairs(l2) do if l3[k] ~= tl then changed = changed + 1 end end
  T.eq(changed, 1, "only the bucket of W's grad is re-made")
  -- zero_grad rebinds W.grad to the optimizer's buffer
  opt:zero_grad()
  T.eq(W.grad:sum():item(), 0)
  -- set_to_none drops grads; a step then skips the params
  opt:zero_grad {set_to_none = true}
  T.eq(rawget(W, 'grad'), nil)
  local w0 = flat(W)
  opt:step()
  T.same(flat(W), w0, 0)
end)

T.test('autograd: an op that returns its argument (contiguous, float of f32) keeps a leaf a leaf', function()
  local W = gp.randn({2, 2}, {device = 'cpu'}):requires_grad()
  T.ok(W:contiguous() == W and W:float() == W)
  T.ok(W:is_leaf(), 'still a leaf')
  local y = W:float() * 2
  y:backward(gp.ones {2, 2})
  T.same(flat(W.grad), {2, 2, 2, 2}, 0)
end)

T.test('zero_grad keeps autograd accumulating into the same objects', function()
  local W = gp.randn({2, 2}, {device = 'cpu'}):requires_grad()
  local opt = optim.SGD({W}, {lr = 0.1})
  opt:zero_grad()
  local g0 = W.grad
  for _ = 1, 2 do
    local y = W * 3
    y:backward(gp.ones {2, 2})
  end
  T.ok(rawget(W, 'grad') == g0, 'backward added into the zeroed buffer')
  T.same(flat(W.grad), {6, 6, 6, 6}, 0)
  opt:zero_grad()
  T.same(flat(W.grad), {0, 0, 0, 0}, 0)
end)

-- count host reads of tensors while fn runs
local function host_reads(fn)
  local n = 0
  local saved = {}
  for _, name in ipairs {'item', 'totable'} do
    saved[name] = Tensor[name]
    Tensor[name] = function(...) n = n + 1; return saved[name](...) end
  end
  local ok, err = pcall(fn)
  for name, f in pairs(saved) do Tensor[name] = f end
  if not ok then error(err, 0) end
  return n
end

T.test('clip_grad_norm: the norm on the device, the clip applied by the next step, no host read', function()
  local W = gp.randn({4, 3}, {device = 'cpu'}):requires_grad()
  local b = gp.randn({3}, {device = 'cpu'}):requires_grad()
  local opt = optim.SGD({W, b}, {lr = 1})
  opt:zero_grad()
  W.grad:copy_(gp.randn({4, 3}, {device = 'cpu'}) * 3)
  b.grad:copy_(gp.randn({3}, {device = 'cpu'}) * 3)
  local gW, gb = flat(W.grad), flat(b.grad)
  local ss = 0
  for _, g in ipairs {gW, gb} do for _, x in ipairs(g) do ss = ss + x * x end end
  local w0, b0 = flat(W), flat(b)
  local norm
  local reads = host_reads(function()
    norm = optim.clip_grad_norm(opt, 1.0)
    opt:step()
  end)
  T.eq(reads, 0, 'no host read in clip + step')
  T.ok(gp.is_tensor(norm), 'the norm is a tensor')
  T.eq(norm:dim(), 0)
  T.eq(norm.device, 'cpu')
  T.near(norm:item(), math.sqrt(ss), 1e-5, 'norm')
  local scale = math.min(1, 1.0 / (math.sqrt(ss) + 1e-6))
  T.ok(scale < 1, 'the test clips')
  near_list(flat(W), (function() local r = {}; for i = 1, 12 do r[i] = w0[i] - scale * gW[i] end; return r end)(), 1e-5, 'W')
  near_list(flat(b), (function() local r = {}; for i = 1, 3 do r[i] = b0[i] - scale * gb[i] end; return r end)(), 1e-5, 'b')
  T.same(flat(W.grad), gW, 0, 'grads are left as they are')
  -- the scale is used once: the next step is unclipped
  local w1 = flat(W)
  opt:step()
  near_list(flat(W), (function() local r = {}; for i = 1, 12 do r[i] = w1[i] - gW[i] end; return r end)(), 1e-5, 'W unclipped')
end)

T.test('clip_grad_norm on a parameter list marks the params for the next step; a large max_norm does not clip', function()
  local W = gp.randn({3, 3}, {device = 'cpu'}):requires_grad()
  local opt = optim.SGD({W}, {lr = 1})
  local params = {W}
  W.grad = gp.full({3, 3}, 2, {device = 'cpu'})
  local n = optim.clip_grad_norm(params, 3)   -- norm 6: scale 0.5
  T.near(n:item(), 6, 1e-6)
  local w0 = flat(W)
  opt:step()
  for i, x in ipairs(flat(W)) do T.near(x, w0[i] - 1, 1e-5) end
  optim.clip_grad_norm(params, 100)
  w0 = flat(W)
  opt:step()
  for i, x in ipairs(flat(W)) do T.near(x, w0[i] - 2, 1e-5) end
  T.raises(function() optim.clip_grad_norm(params, 0) end, 'max_norm')
  W.grad = nil
  T.raises(function() optim.clip_grad_norm(params, 1) end, 'no parameter has a gradient')
end)

T.test('schedules: warmup, cosine, linear', function()
  local s = optim.schedule.cosine {lr = 1, min_lr = 0.1, warmup = 10, max_steps = 110}
  T.near(s(1), 0.1, 1e-12)
  T.near(s(5), 0.5, 1e-12)
  T.near(s(10), 1, 1e-12)
  T.near(s(60), 0.1 + 0.9 * 0.5, 1e-12, 'half way')
  T.near(s(35), 0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)), 1e-12)
  T.near(s(110), 0.1, 1e-12)
  T.near(s(500), 0.1, 1e-12)
  local w = optim.schedule.warmup {lr = 2, warmup = 4}
  T.near(w(1), 0.5, 1e-12); T.near(w(4), 2, 1e-12); T.near(w(100), 2, 1e-12)
  local l = optim.schedule.linear {lr = 1, max_steps = 11, warmup = 1}
  T.near(l(6), 0.5, 1e-12); T.near(l(11), 0, 1e-12)
  local c0 = optim.schedule.cosine {lr = 3, max_steps = 10}
  T.near(c0(0), 3, 1e-12)
  T.raises(function() optim.schedule.cosine {lr = 1} end, 'max_steps')
  T.raises(function() optim.schedule.cosine {lr = 1, max_steps = 5, warmup = 6} end, 'warmup')
  -- set_lr applies to every group, times lr_scale
  local opt = optim.SGD({{params = {gp.zeros {2}}}, {params = {gp.zeros {2}}, lr_scale = 0.5}})
  opt:set_lr(s(5))
  T.near(opt.param_groups[1].lr, 0.5, 1e-12)
  T.near(opt.param_groups[2].lr, 0.25, 1e-12)
  T.near(opt:get_lr(), 0.5, 1e-12)
end)

T.test('state_dict round trip through gp.save continues the same trajectory', function()
  local function make()
    gp.manual_seed(7)
    local W = gp.randn({3, 4}, {device = 'cpu'}):requires_grad()
    local b = gp.randn({4}, {device = 'cpu'}):requires_grad()
    return W, b, optim.AdamW({W, b}, {lr = 0.01})
  end
  local W, b, opt = make()
  local grads = {}
  for i = 1, 4 do grads[i] = {gp.randn({3, 4}, {device = 'cpu'}), gp.randn({4}, {device = 'cpu'})} end
  local function step(o, Wt, bt, i)
    o:zero_grad(); Wt.grad:copy_(grads[i][1]); bt.grad:copy_(grads[i][2]); o:step()
  end
  step(opt, W, b, 1); step(opt, W, b, 2)
  local path = os.tmpname()
  gp.save(path, opt:state_dict())
  local W2, b2, opt2 = make()
  gp.no_grad(function() W2:copy_(W); b2:copy_(b) end)
  opt2:load_state_dict(gp.load(path))
  os.remove(path)
  T.eq(opt2.step_count, 2)
  step(opt, W, b, 3); step(opt2, W2, b2, 3)
  step(opt, W, b, 4); step(opt2, W2, b2, 4)
  T.same(flat(W2), flat(W), 1e-7)
  T.same(flat(b2), flat(b), 1e-7)
  local sd, meta = opt:state_dict()
  T.eq(meta.optimizer, 'AdamW')
  T.ok(sd['exp_avg.1'] and sd['exp_avg_sq.2'], 'moments are named <state>.<param index>')
  local sgd = optim.SGD({W}, {lr = 1})
  T.raises(function() sgd:load_state_dict(opt:state_dict()) end, 'AdamW optimizer')
  T.raises(function() opt2:load_state_dict({['exp_avg.9'] = gp.zeros {2}}) end, "unknown entry 'exp_avg.9'")
  T.raises(function() opt2:load_state_dict({['exp_avg.1'] = gp.zeros {2}}) end, 'exp_avg.1', '(3,4)')
end)

T.test('mixed precision on the CPU: bf16 params, f32 masters updated from bf16 grads', function()
  local W = gp.randn({4, 6}, {device = 'cpu'}):requires_grad()
  local b = gp.randn({6}, {device = 'cpu'}):requires_grad()
  local model = {}
  function model:parameters() return {W, b} end
  local W32 = flat(W)
  T.ok(optim.mixed_precision(model) == model)
  T.eq(W.dtype, 'bf16'); T.eq(b.dtype, 'bf16')
  T.ok(W:needs_grad(), 'still requires grad')
  local h = {lr = 0.01, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1}
  local opt = optim.AdamW(model, h)
  -- the master starts from the bf16 values
  local rW, m, v = flat(W), zeros(24), zeros(24)
  for step = 1, 3 do
    opt:zero_grad()
    T.eq(W.grad.dtype, 'bf16')
    local x = gp.randn({4, 6}, {device = 'cpu'}):bf16()
    local y = W * x             -- autograd in bf16
    y:backward(gp.ones({4, 6}, {dtype = 'bf16', device = 'cpu'}))
    local g = flat(W.grad)
    near_list(g, flat(x), 0, 'dW = x step ' .. step)
    ref_adamw(rW, m, v, g, h, step, true)
    opt:step()
    local master = opt.state[1].master
    T.eq(master.dtype, 'f32')
    near_list(flat(master), rW, 1e-5, 'master step ' .. step)
    T.same(flat(W), flat(master:bf16()), 0, 'the bf16 param is the rounded master')
  end
  T.ok(math.abs(flat(W)[1] - W32[1]) < 0.1, 'sanity')
  local no = optim.AdamW({gp.zeros({2, 2}, {dtype = 'bf16', device = 'cpu'})}, {master_weights = false})
  no:zero_grad()
  T.raises(function() no:step() end, 'bf16', 'master_weights')
end)

T.test('optimizers on CUDA: the same numbers as on the CPU', function()
  T.cuda()
  for _, kind in ipairs {'AdamW', 'SGD'} do
    local res = {}
    for _, dev in ipairs {'cpu', 'cuda'} do
      gp.manual_seed(3)
      local W = gp.randn({33, 17}, {device = 'cpu'}):to(dev):requires_grad()
      local b = gp.randn({17}, {device = 'cpu'}):to(dev):requires_grad()
      local opt = optim[kind]({W, b}, {lr = 0.01, momentum = 0.9, weight_decay = 0.1})
      for _ = 1, 3 do
        opt:zero_grad()
        W.grad:copy_(gp.randn({33, 17}, {device = 'cpu'}):to(dev))
        b.grad:copy_(gp.randn({17}, {device = 'cpu'}):to(dev))
        local n = optim.clip_grad_norm(opt, 5)
        T.eq(n.device, dev)
        opt:step()
      end
      res[dev] = {W:cpu(), b:cpu()}
    end
    T.ok(T.relnorm(res.cuda[1], res.cpu[1]) < 1e-5, kind .. ' W')
    T.ok(T.relnorm(res.cuda[2], res.cpu[2]) < 1e-5, kind .. ' b')
  end
end)

-- device_hyper: the kernels read lr and the bias corrections from a device
-- tensor; the same trajectory as launch arguments, and a "captured" step
-- (opt._capturing) neither advances the count nor writes the values, which
-- prepare_replay does instead
T.test('device_hyper: the same steps as launch arguments; prepare_replay advances and writes', function()
  for _, dev in ipairs {'cpu', 'cuda'} do
    if dev == 'cpu' or gp.cuda_available() then
      for _, kind in ipairs {'AdamW', 'SGD'} do
        local res = {}
        for _, dh in ipairs {false, true} do
          gp.manual_seed(5)
          local W = gp.randn({9, 5}, {device = 'cpu'}):to(dev):requires_grad()
          local opt = optim[kind]({W}, {lr = 0.05, momentum = 0.9, weight_decay = 0.1, device_hyper = dh})
          local grads = {}
          for s = 1, 4 do grads[s] = gp.randn({9, 5}, {device = 'cpu'}):to(dev) end
          for s = 1, 4 do
            opt:zero_grad(); W.grad:copy_(grads[s])
            opt:set_lr(0.05 / s)
            if dh and s >= 3 then
              -- what a captured step does: launch with the values last written,
              -- after prepare_replay wrote this step's
              opt:prepare_replay()
              opt._capturing = true; opt:step(); opt._capturing = nil
            else
              opt:step()
            end
          end
          T.eq(opt.step_count, 4)
          res[dh] = W:cpu()
        end
        T.ok(T.relnorm(res[true], res[false]) < 1e-6, dev .. ' ' .. kind)
      end
    end
  end
  local opt = optim.AdamW({gp.randn({3}, {device = 'cpu'}):requires_grad()})
  T.raises(function() opt:prepare_replay() end, 'device_hyper')
  T.raises(function() opt:capture(function() end) end, 'device_hyper')
end)

---------------------------------------------------------------------------
-- mixed precision in one launch: the multi-tensor kernels write each updated
-- master into its bf16/f16 parameter (rounded to nearest even, as k.copy
-- rounds). The "old path" is computed explicitly: a second optimizer over
-- f32 copies of the parameters (the same kernel, the same gradients), whose
-- values are then converted with an explicit copy (p:to(dtype)).

local core = require 'gpush.core.runtime'
local tensor_mod = require 'gpush.core.tensor'

local function maxdiff(a, b) return (a:float() - b:float()):abs():max():item() end

-- specs: {shape=, dtype= (of the param), gdtype= (of its grad; default the
-- param's), t=true (a transposed, non-contiguous param)}
local function mixed_run(kind, dev, specs, steps, opts)
  gp.manual_seed(11)
  local ps, refs = {}, {}
  for i, s in ipairs(specs) do
    if s.t then
      ps[i] = gp.randn({s.shape[2], s.shape[1]}, {device = 'cpu'}):to(dev):to(s.dtype):t():requires_grad()
    else
      ps[i] = gp.randn(s.shape, {device = 'cpu'}):to(dev):requires_grad()
    end
  end
  for _, dt in ipairs {'bf16', 'f16'} do
    local sub = {}
    for i, s in ipairs(specs) do if s.dtype == dt and not s.t then sub[#sub + 1] = ps[i] end end
    if #sub > 0 then optim.mixed_precision(sub, {dtype = dt}) end
  end
  for i, p in ipairs(ps) do refs[i] = p:detach():float():contiguous():clone() end
  local h = {lr = 0.01, momentum = 0.9, nesterov = kind == 'SGD', weight_decay = 0.1}
  for k, v in pairs(opts or {}) do h[k] = v end
  local opt, ref = optim[kind](ps, h), optim[kind](refs, h)
  for s = 1, steps do
    opt:zero_grad()
    for i, p in ipairs(ps) do
      local g = gp.randn(p.shape, {device = 'cpu'}):to(dev):to(specs[i].gdtype or p.dtype)
      if specs[i].gdtype then p.grad = g else p.grad:copy_(g) end
      refs[i].grad = p.grad:contiguous()
    end
    opt:step(); ref:step()
    for i, p in ipairs(ps) do
      local what = string.format('%s %s step %d param %d (%s)', kind, dev, s, i, p.dtype)
      T.eq(p.dtype, specs[i].dtype, what)
      if p.dtype ~= 'f32' then
        T.eq(maxdiff(opt.state[i].master, refs[i]), 0, what .. ': the master is the f32 update')
        T.eq(maxdiff(p, opt.state[i].master:to(p.dtype)), 0, what .. ': the param is its master rounded')
      end
      T.eq(maxdiff(p, refs[i]:to(p.dtype)), 0, what .. ': the same as the update then an explicit copy')
    end
  end
  return ps, opt
end

-- kernel calls (gp.k, as gp.profile wraps them) and multi-tensor launches
-- (the optimizer's core.call) while fn runs
local function count_launches(fn)
  local n, saved_k, saved_t, call = {k = 0, multi = 0}, {}, {}, core.call
  for name, f in pairs(gp.k) do saved_k[name] = f; gp.k[name] = function(...) n.k = n.k + 1; return f(...) end end
  for name, f in pairs(tensor_mod.K) do saved_t[name] = f; tensor_mod.K[name] = gp.k[name] end
  core.call = function(f, ...) n.multi = n.multi + 1; return call(f, ...) end
  local ok, err = pcall(fn)
  for name, f in pairs(saved_k) do gp.k[name] = f end
  for name, f in pairs(saved_t) do tensor_mod.K[name] = f end
  core.call = call
  if not ok then error(err, 0) end
  return n
end

local function nlists(opt)
  local all, low = 0, 0
  for _, c in pairs(opt._lists) do all = all + 1; if c.low then low = low + 1 end end
  return all, low
end

T.test('mixed precision: the kernel writes the bf16/f16 params, bit for bit the old copy-back (AdamW, SGD)', function()
  for _, kind in ipairs {'AdamW', 'SGD'} do
    for _, dt in ipairs {'bf16', 'f16'} do
      local _, opt = mixed_run(kind, 'cpu', {{shape = {7, 5}, dtype = dt}, {shape = {5}, dtype = dt}}, 4)
      local all, low = nlists(opt)
      T.eq(all, 2, kind .. ' ' .. dt .. ': two buckets (decay, no decay)')
      T.eq(low, 2, kind .. ' ' .. dt .. ': both write their params')
      for _, c in pairs(opt._lists) do T.eq(#c.groups, kind == 'AdamW' and 5 or 4) end
    end
  end
end)

T.test('mixed precision: f32 and bf16 params (bf16 and f32 grads) and a non-contiguous bf16 param in one model', function()
  for _, kind in ipairs {'AdamW', 'SGD'} do
    local specs = {{shape = {6, 4}, dtype = 'bf16'}, {shape = {4}, dtype = 'f32'}, {shape = {3, 4}, dtype = 'bf16', gdtype = 'f32'},
                   {shape = {4, 3}, dtype = 'f32', gdtype = 'bf16'}, {shape = {2, 5}, dtype = 'bf16', t = true}}
    local ps, opt = mixed_run(kind, 'cpu', specs, 3)
    T.ok(not ps[5]:is_contiguous(), 'the test has a non-contiguous param')
    local all, low = nlists(opt)
    -- decay: (bf16 grad, bf16 param) (f32 grad, bf16) (bf16 grad, f32) (bf16 grad, non-contiguous bf16); no decay: f32
    T.eq(all, 5, kind .. ' buckets')
    T.eq(low, 2, kind .. ' buckets whose kernel writes the params')
    -- one launch per bucket; only the non-contiguous param is copied back
    opt:zero_grad()
    for i, p in ipairs(ps) do
      if specs[i].gdtype then p.grad = gp.full(p.shape, 0.5, {dtype = specs[i].gdtype, device = 'cpu'}) else p.grad:fill_(0.5) end
    end
    local n = count_launches(function() opt:step() end)
    T.eq(n.multi, 5, kind .. ' launches')
    T.eq(n.k, 1, kind .. ' kernel calls: the copy of the non-contiguous param')
  end
end)

T.test('mixed precision: a step is one launch per bucket, no copy per parameter', function()
  local l1, l2 = gp.nn.Linear(8, 16, {device = 'cpu'}), gp.nn.Linear(16, 4, {device = 'cpu'})
  local model = {}
  function model:parameters() return {l1.weight, l1.bias, l2.weight, l2.bias} end
  local np = #model:parameters()
  optim.mixed_precision(model)
  for _, kind in ipairs {'AdamW', 'SGD'} do
    local opt = optim[kind](model, {lr = 0.01})
    for s = 1, 2 do
      opt:zero_grad()
      for _, p in ipairs(model:parameters()) do p.grad:copy_(gp.randn(p.shape, {device = p.device})) end
      local n = count_launches(function() opt:step() end)
      local all = nlists(opt)
      T.eq(all, 2, kind .. ' buckets')
      if s == 2 then -- the first step also makes the moments
        T.eq(n.k, 0, kind .. ': no k.copy per parameter (there were ' .. np .. ')')
      end
      T.eq(n.multi, all, kind .. ': one launch per bucket')
      for i, p in ipairs(model:parameters()) do T.eq(maxdiff(p, opt.state[i].master:bf16()), 0, kind .. ' param ' .. i) end
    end
  end
end)

T.test('mixed precision with the extended kernels: CUDA against the CPU, and bit for bit the copy-back on CUDA', function()
  T.cuda()
  -- {300, 230}: more than one chunk of the multi-tensor walk
  local specs = {{shape = {300, 230}, dtype = 'bf16'}, {shape = {230}, dtype = 'bf16'}, {shape = {33, 17}, dtype = 'f16'},
                 {shape = {17}, dtype = 'f32'}, {shape = {9, 5}, dtype = 'bf16', gdtype = 'f32'},
                 {shape = {4, 6}, dtype = 'bf16', t = true}}
  for _, kind in ipairs {'AdamW', 'SGD'} do
    for _, dh in ipairs {false, true} do
      local res = {}
      for _, dev in ipairs {'cpu', 'cuda'} do
        local ps, opt = mixed_run(kind, dev, specs, 3, {device_hyper = dh})
        res[dev] = {ps = ps, opt = opt}
      end
      for i, p in ipairs(res.cuda.ps) do
        local what = string.format('%s device_hyper=%s param %d', kind, tostring(dh), i)
        T.eq(p.device, 'cuda')
        local tol = p.dtype == 'f32' and 1e-5 or 1e-2
        T.ok(T.relnorm(p:cpu(), res.cpu.ps[i]) < tol, what)
        local m = res.cuda.opt.state[i].master
        if m then T.ok(T.relnorm(m:cpu(), res.cpu.opt.state[i].master) < 1e-5, what .. ' master') end
      end
    end
  end
end)

T.test('multi-tensor lists: a fifth (fourth for SGD) group must be bf16 or f16', function()
  local ffi = require 'ffi'
  local C = core.C
  local function tl(groups)
    local n, ng = #groups[1], #groups
    local ts = ffi.new('const gp_tensor *[?]', ng * n)
    for g = 1, ng do for i = 1, n do ts[(g - 1) * n + i - 1] = groups[g][i].c end end
    local box = ffi.new('gp_tlist*[1]')
    core.call(C.gp_tlist_create, box, ng, n, ts)
    return ffi.gc(box[0], C.gp_tlist_free)
  end
  local function f32() return gp.randn({3}, {device = 'cpu'}) end
  local p, m, v, g = f32(), f32(), f32(), f32()
  T.raises(function() core.call(C.gp_multi_adamw, tl {{p}, {m}, {v}, {g}, {f32()}}, nil, nil, 0.1, 0.9, 0.9, 1e-8, 0, 1) end,
    'multi_adamw', 'group 5', 'bf16 or f16')
  T.raises(function() core.call(C.gp_multi_sgd, tl {{p}, {m}, {g}, {f32()}}, nil, nil, 0.1, 0.9, 0, 0) end,
    'multi_sgd', 'group 4', 'bf16 or f16')
  T.raises(function() core.call(C.gp_multi_sgd, tl {{p}, {m}, {g}, {f32():bf16()}, {f32():bf16()}}, nil, nil, 0.1, 0.9, 0, 0) end,
    'multi_sgd', '5 groups')
  T.raises(function() tl {{p}, {m}, {v}, {g}, {gp.randn({4}, {device = 'cpu'}):bf16()}} end, 'tlist', 'tensor 1')
  -- a low group is written: p rounded
  local low = gp.zeros({3}, {dtype = 'bf16', device = 'cpu'})
  core.call(C.gp_multi_sgd, tl {{p}, {m}, {g}, {low}}, nil, nil, 0.1, 0.9, 0, 0)
  T.eq(maxdiff(low, p:bf16()), 0)
end)

T.test('device_hyper: prepare_replay allocates nothing (one host staging tensor per bucket)', function()
  for _, dev in ipairs {'cpu', 'cuda'} do
    if dev == 'cpu' or gp.cuda_available() then
      for _, kind in ipairs {'AdamW', 'SGD'} do
        local W = gp.randn({4, 3}, {device = 'cpu'}):to(dev):requires_grad()
        local b = gp.randn({3}, {device = 'cpu'}):to(dev):requires_grad()
        local opt = optim[kind]({W, b}, {lr = 0.05, device_hyper = true})
        opt:zero_grad(); opt:step()
        collectgarbage('collect')
        local s0 = gp.memory()
        for _ = 1, 3 do opt:prepare_replay() end
        local s1 = gp.memory()
        T.eq(s1.allocs, s0.allocs, dev .. ' ' .. kind .. ' device allocations')
        T.eq(s1.host_allocs, s0.host_allocs, dev .. ' ' .. kind .. ' host allocations')
        T.eq(opt.step_count, 4)
        for _, c in pairs(opt._lists) do
          local h = c.hyper:cpu():totable()
          T.near(h[1], 0.05, 1e-7)
          if kind == 'AdamW' then T.near(h[2], 1 - 0.9 ^ 4, 1e-6); T.near(h[3], 1 - 0.95 ^ 4, 1e-6) end
          T.eq(c.hyper_host ~= nil, dev ~= 'cpu', 'a host staging tensor only for a device list')
        end
      end
    end
  end
end)

-- gp.k.sumsq reads 16-byte vectors from the tensor's first 16-byte boundary: every offset of a view and every
-- tail agree with the CPU
T.test('sumsq (cuda): views at every offset of a 16-byte vector equal the CPU', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local x = gp.randn({5000}, {device = 'cpu'}):type(dt)
    local xg = x:cuda()
    for _, off in ipairs {0, 1, 2, 3, 5, 7} do
      for _, n in ipairs {1, 9, 4093} do
        local a, b = gp.zeros({1}, {device = 'cpu'}), gp.zeros({1}, {device = 'cuda'})
        gp.k.sumsq(a, x:narrow(1, off + 1, n))
        gp.k.sumsq(b, xg:narrow(1, off + 1, n))
        local want, got = a:item(), b:cpu():item()
        T.ok(math.abs(got - want) <= 1e-5 * math.abs(want), string.format('%s offset %d n %d: %g vs %g', dt, off, n,
          got, want))
      end
    end
  end
end)
