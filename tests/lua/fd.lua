-- Central finite differences for gradient checks, on f64 CPU tensors.
--   fd.grad(f, args, i, dout, h): the numeric gradient of sum(f(args...) * dout)
--     with respect to the tensor args[i] (f returns a tensor; its first result counts)
--   fd.check(what, analytic, numeric, tol): relative norm of the difference under tol
local gp = require 'gpush'
local ffi = require 'ffi'
local tensor = require 'gpush.tensor'
local M = {}

local function dot(a, b)
  local x, n = tensor.to_doubles(a)
  local y, m = tensor.to_doubles(b)
  assert(n == m, 'fd: output and dout sizes differ')
  local s = 0
  for k = 0, n - 1 do s = s + x[k] * y[k] end
  return s
end

function M.grad(f, args, i, dout, h)
  h = h or 1e-6
  local x = args[i]
  assert(x.dtype == 'f64' and x.device == 'cpu' and x:is_contiguous(), 'fd.grad: args[i] must be a contiguous f64 cpu tensor')
  local p = ffi.cast('double *', x.c.data) + x.c.offset
  local n = x:numel()
  local g = {}
  for k = 0, n - 1 do
    local v = p[k]
    p[k] = v + h
    local lp = dot((f(unpack(args))), dout)
    p[k] = v - h
    local lm = dot((f(unpack(args))), dout)
    p[k] = v
    g[k + 1] = (lp - lm) / (2 * h)
  end
  return gp.tensor(g, {dtype = 'f64', device = 'cpu'}):view(x.shape)
end

function M.check(what, analytic, numeric, tol)
  local T = require 'lib'
  local r = T.relnorm(analytic, numeric)
  if not (r <= (tol or 1e-6)) then
    error(string.format('%s: analytic vs finite-difference gradient relative norm %g > %g', what, r, tol or 1e-6), 2)
  end
  return r
end

-- a random f64 cpu tensor
function M.randn(shape) return gp.randn(shape, {dtype = 'f64', device = 'cpu'}) end

return M
