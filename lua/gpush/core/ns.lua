-- ns: the table of the core's functions (gp.zeros, gp.matmul, gp.no_grad, ...).
-- The core's modules add to it as they load and look each other's functions
-- up in it when they run, so a call always reaches the current function (the
-- one autograd wrapped). Inside the library this table is the local `gp`;
-- `require 'gpush.core'` returns it complete, and the gp facade re-exports it.
local doc = require 'gpush.core.doc'
return {doc = doc.doc, _docs = doc.docs}
