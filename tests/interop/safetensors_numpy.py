"""Interop with the safetensors package through numpy (no torch needed): load a
file gpush wrote and compare it with the expected values; then write a file
for gpush to load.
Usage: python3 safetensors_numpy.py OURS.safetensors THEIRS.safetensors

numpy has no bfloat16, so safetensors.numpy.load_file (and safe_open(...,
'np').get_tensor) refuse a BF16 tensor ("data type 'bfloat16' not
understood"). Read such files with safetensors.torch, with the ml_dtypes
package (numpy dtypes bfloat16 and float8), or by hand as here: the file is
an 8-byte little-endian header length, a JSON header and the data, and a
bf16 value is the upper half of an f32 (bits << 16)."""
import json
import struct
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file


def read_raw(path):
    """{name: (dtype string, shape, bytes)} and the metadata, from the file itself"""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}, meta


def bf16_to_f32(raw, shape):
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)


def f32_to_bf16_bits(x):
    """round to nearest even, as gpush and torch do"""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


ours, theirs = sys.argv[1], sys.argv[2]
expect = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4) / 4,
    "f16": np.array([0.5, -1.25, 3.0], dtype=np.float16),
    "i64": np.array([[1, -2], [3, 40000000000]], dtype=np.int64),
    "i32": np.array([7, -8, 9], dtype=np.int32),
    "u8": np.array([0, 1, 255], dtype=np.uint8),
    "f64": np.array([1 / 3, -2.0], dtype=np.float64),
}
with safe_open(ours, framework="np") as f:
    assert f.metadata()["note"] == "from gpush", f.metadata()
    for k, v in expect.items():
        t = f.get_tensor(k)
        assert t.dtype == v.dtype, (k, t.dtype, v.dtype)
        assert np.array_equal(t, v), (k, t, v)
raw, meta = read_raw(ours)
assert meta["note"] == "from gpush", meta
dt, shape, b = raw["bf16"]
assert dt == "BF16" and shape == [6], (dt, shape)
assert np.array_equal(bf16_to_f32(b, shape), np.arange(6, dtype=np.float32) - 2.5), bf16_to_f32(b, shape)

save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.array([3, 1, 4], dtype=np.int64)},
          theirs, metadata={"note": "from numpy"})
# a bf16 tensor added by hand: the header gains an entry, the data its bytes
raw, meta = read_raw(theirs)
h = f32_to_bf16_bits([1.5, -2.0]).tobytes()
header, data, off = {"__metadata__": meta}, b"", 0
for k, (dt, shape, b) in sorted(raw.items()) + [("h", ("BF16", [2], h))]:
    header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
    data += b
    off += len(b)
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
with open(theirs, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + data)
print("numpy interop ok")
