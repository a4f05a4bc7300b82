"""Interop with PyTorch's safetensors: load a file gpush wrote and compare it
with the expected values; then write a file for gpush to load.
Usage: python3 safetensors_torch.py OURS.safetensors THEIRS.safetensors"""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ours, theirs = sys.argv[1], sys.argv[2]
t = load_file(ours)
expect = {
    "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4,
    "bf16": (torch.arange(6, dtype=torch.float32) - 2.5).to(torch.bfloat16),
    "f16": torch.tensor([0.5, -1.25, 3.0], dtype=torch.float16),
    "i64": torch.tensor([[1, -2], [3, 40000000000]], dtype=torch.int64),
    "i32": torch.tensor([7, -8, 9], dtype=torch.int32),
    "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
    "f64": torch.tensor([1 / 3, -2.0], dtype=torch.float64),
}
for k, v in expect.items():
    assert t[k].dtype == v.dtype, (k, t[k].dtype, v.dtype)
    assert torch.equal(t[k], v), (k, t[k], v)
with safe_open(ours, framework="pt") as f:
    assert f.metadata()["note"] == "from gpush", f.metadata()
save_file(
    {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "h": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
     "ids": torch.tensor([3, 1, 4], dtype=torch.int64)},
    theirs, metadata={"note": "from torch"})
print("torch interop ok")
