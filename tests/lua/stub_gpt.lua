-- A stand-in for gp.nn.GPT with the same interface, built only from ops that
-- autograd differentiates today (elementwise, views): the loss is a squared
-- distance of the parameters from 0.5, so training must lower it. It lets the
-- tests run scripts/train_gpt.lua end to end (--model tests/lua/stub_gpt.lua)
-- without the nn module.
return function(gp, cfg)
  local V, n = cfg.vocab_size, cfg.n_embd
  local w = gp.randn({V, n}):requires_grad()
  local b = gp.zeros({n}):requires_grad()
  local m = {training = true, config = cfg}
  function m:parameters() return {w, b} end
  function m:named_parameters() return {{'w', w}, {'b', b}} end
  function m:state_dict() return {w = w, b = b} end
  function m:train() self.training = true; return self end
  function m:eval() self.training = false; return self end
  setmetatable(m, {__call = function(self, idx, targets)
    local B, T = idx:size(1), idx:size(2)
    local logits = gp.zeros({B, T, V})
    if not targets then return logits end
    local d = w - 0.5
    local e = b - 0.5
    local loss = ((d * d):view {V * n}:narrow(1, 1, 1):view {} + (e * e):view {n}:narrow(1, 1, 1):view {})
    return logits, loss
  end})
  return m
end
