-- Checkpoints read and written by the Python safetensors package: through
-- PyTorch where python3 has torch (e.g. the GPU machine), and through numpy
-- where it has numpy (pip install safetensors numpy: no torch needed); each
-- is skipped with a message where its packages are missing.
local T = require 'lib'
local gp = require 'gpush'

local function write_ours(ours)
  local cpu = {device = 'cpu'}
  gp.save(ours, {
    f32 = gp.arange(12, cpu):float():view(3, 4) / 4,
    bf16 = (gp.arange(6, cpu):float() - 2.5):bf16(),
    f16 = gp.tensor({0.5, -1.25, 3}, {dtype = 'f16', device = 'cpu'}),
    i64 = gp.tensor({{1, -2}, {3, 40000000000}}, {dtype = 'i64', device = 'cpu'}),
    i32 = gp.tensor({7, -8, 9}, {dtype = 'i32', device = 'cpu'}),
    u8 = gp.tensor({0, 1, 255}, {dtype = 'u8', device = 'cpu'}),
    f64 = gp.tensor({1 / 3, -2}, {dtype = 'f64', device = 'cpu'}),
  }, {note = 'from gpush'})
end

-- python3 SCRIPT ours theirs, then gpush reads theirs
local function round_trip(script, note)
  local ours, theirs = os.tmpname() .. '.safetensors', os.tmpname() .. '.safetensors'
  write_ours(ours)
  local root = (GPUSH_ROOT or '.')
  local out, rc = T.sh(string.format('python3 %s/tests/interop/%s %s %s', root, script, ours, theirs))
  T.eq(rc, 0, out)
  local t, meta = gp.load(theirs)
  T.same(t.w:totable(), {{0, 1, 2}, {3, 4, 5}})
  T.eq(t.h.dtype, 'bf16'); T.same(t.h:totable(), {1.5, -2})
  T.eq(t.ids.dtype, 'i64'); T.same(t.ids:totable(), {3, 1, 4})
  T.eq(meta.note, note)
  os.remove(ours); os.remove(theirs)
end

T.test('safetensors files round-trip through PyTorch', function()
  local _, rc = T.sh("python3 -c 'import torch, safetensors' >/dev/null 2>&1")
  if rc ~= 0 then T.skip('python3 with torch and safetensors not found (the numpy case runs without torch)') end
  round_trip('safetensors_torch.py', 'from torch')
end)

T.test('safetensors files round-trip through numpy (no torch; bf16 read and written by hand)', function()
  local _, rc = T.sh("python3 -c 'import numpy, safetensors.numpy' >/dev/null 2>&1")
  if rc ~= 0 then T.skip('python3 with numpy and safetensors not found (pip install safetensors numpy)') end
  round_trip('safetensors_numpy.py', 'from numpy')
end)
