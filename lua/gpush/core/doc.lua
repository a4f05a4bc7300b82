-- doc: what help(x) prints. doc(fn, usage, text) records the usage line and a
-- one-line doc of fn (returns fn); the API reference (docs/api.md, `make docs`)
-- is generated from the same records.
local M = {docs = {}} -- function or table -> {usage =, doc =, kernel =}

function M.doc(fn, usage, text)
  M.docs[fn] = {usage = usage, doc = text}
  return fn
end

return M
