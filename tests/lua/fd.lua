-- Central finite differences for gradient checks, on f64 CPU tensors.
--   fd.grad(f, args, i, dout, h): the numeric gradient of sum(f(args...) * dout)
--     with respect to the tensor args[i] (f returns a tensor; its first result counts)
--   fd.check(what, analytic, numeric, tol): relative norm of the difference under tol
local gp = require 'gpush'
local ffi = require 'ffi'
local tensor = require 'gpush.core.tensor'
local M = {}

local function dot(a, b)
  local x, n = tensor.to_doubles(a)
  local y, m = tensor.to_doubles(b)
  assert(n == m, 'fd: output and dout sizes differ')
  local s = 0
  for k = 0, n - 1 do s = s + x[k] * y[k] end
  return s
end

--   fd.scalar(loss, x, h): the numeric gradient of the number loss() with
--     respect to the f64 tensor x, as a flat Lua list
function M.scalar(loss, x, h)
  h = h or 1e-6
  assert(x.dtype == 'f64' and x.device == 'cpu' and x:is_contiguous(), 'fd: x must be a contiguous f64 cpu tensor')
  local p = ffi.cast('double *', x.c.data) + x.c.offset
  local g = {}
  for k = 0, x:numel() - 1 do
    local v = p[k]
    p[k] = v + h
    local lp = loss()
    p[k] = v - h
    local lm = loss()
    p[k] = v
    g[k + 1] = (lp - lm) / (2 * h)
  end
  return g
end

function M.grad(f, args, i, dout, h)
  local g = M.scalar(function() return dot((f(unpack(args))), dout) end, args[i], h)
  return gp.tensor(g, {dtype = 'f64', device = 'cpu'}):view(args[i].shape)
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
