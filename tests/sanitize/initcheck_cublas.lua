-- tests/sanitize/initcheck_cublas.lua: is a cuBLAS product "uninitialized" to
-- compute-sanitizer's initcheck? Products of f32 and bf16 matrices, each
-- read back by a kernel of gpush (the cast to f32); BEGIN/END lines bracket
-- each so the log shows which product the reports follow:
--   compute-sanitizer --tool initcheck build/gpush -e 'jit.off()' tests/sanitize/initcheck_cublas.lua
-- On the H100 (CUDA 13.0): no report after the f32 products, a report for
-- every element of every bf16 one (cuBLAS's bf16 kernels store with TMA,
-- which initcheck does not track). With GPUSH_SANITIZER=initcheck set (as
-- make sanitize does) the products zero their outputs first: no report.
-- Without a GPU it runs on the CPU (nothing to see).
local dev = gp.cuda_available() and 'cuda' or 'cpu'
for _, dt in ipairs {'f32', 'bf16'} do
  for _, n in ipairs {64, 256, 1024} do
    local a = gp.randn({n, n}, {device = dev}):to(dt)
    local w = gp.randn({n, n}, {device = dev}):to(dt)
    gp.sync()
    io.stdout:write(string.format('BEGIN %s %d\n', dt, n)); io.stdout:flush()
    local s = a:matmul(w):float():sum():item()
    gp.sync()
    io.stdout:write(string.format('END %s %d %g\n', dt, n, s)); io.stdout:flush()
  end
end
