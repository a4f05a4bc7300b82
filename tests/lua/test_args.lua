-- gp.args: script flags (types from defaults, --flag/--no-flag, --name=value,
-- errors that name the flag, --help listing).
local T = require 'lib'

local SPEC = {
  {'iters', 1000, 'training steps'},
  {'lr', 3e-4, 'learning rate'},
  {'n-embd', 128, 'width'},
  {'data', '', 'a text file'},
  {'bf16', false, 'bf16 training'},
  {'fused', true, 'fused kernels'},
  {'out', nil, 'checkpoint', type = 'string'},
}

T.test('defaults, values, flags and positional arguments', function()
  local o = gp.args.parse({}, SPEC)
  T.eq(o.iters, 1000); T.eq(o.lr, 3e-4); T.eq(o.n_embd, 128); T.eq(o.data, ''); T.eq(o.bf16, false)
  T.eq(o.fused, true); T.eq(o.out, nil)
  o = gp.args.parse({'--iters', '50', '--lr=1e-2', '--n-embd', '64', '--bf16', '--no-fused', 'pos', '--data', 'x.txt',
                     '--out', 'ck.st'}, SPEC)
  T.eq(o.iters, 50); T.eq(o.lr, 0.01); T.eq(o.n_embd, 64); T.eq(o.bf16, true); T.eq(o.fused, false)
  T.eq(o.data, 'x.txt'); T.eq(o.out, 'ck.st'); T.eq(#o._rest, 1); T.eq(o._rest[1], 'pos')
  o = gp.args.parse({'--bf16=false', '--n_embd', '-3'}, SPEC)
  T.eq(o.bf16, false); T.eq(o.n_embd, -3)
end)

T.test('errors name the flag', function()
  T.raises(function() gp.args.parse({'--nope'}, SPEC) end, 'unknown flag --nope')
  T.raises(function() gp.args.parse({'--iters'}, SPEC) end, '--iters needs a value')
  T.raises(function() gp.args.parse({'--iters', 'ten'}, SPEC) end, "--iters needs a number, got 'ten'")
  T.raises(function() gp.args.parse({'--bf16=maybe'}, SPEC) end, '--bf16 is a flag')
  T.raises(function() gp.args.parse({'--no-iters'}, SPEC) end, 'not a flag')
  T.raises(function() gp.args.parse({}, {{'x', nil, 'no type'}}) end, 'needs a default or type')
end)

T.test('--help lists every flag with its default', function()
  local o, text = gp.args.parse({'--help'}, SPEC, {exit = false, usage = 'gpush x.lua [flags]'})
  T.eq(o, nil)
  T.ok(text:find('usage: gpush x.lua [flags]', 1, true), text)
  T.ok(text:find('--iters N', 1, true) and text:find('(default 1000)', 1, true), text)
  T.ok(text:find('--n-embd N', 1, true), text)
  T.ok(text:find('--bf16 ', 1, true) and text:find('--out S', 1, true), text)
  T.ok(text:find('--help', 1, true), text)
end)
