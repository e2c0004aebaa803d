"""Minimal safetensors reader and writer (F32, F16, BF16, and U8 / F8_E4M3 bytes) for Loom's test scripts.

Format: an 8-byte little-endian u64 header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data section; offsets are relative to the start of the data section.
U8 tensors (MXFP4 blocks and E8M0 scales) are written from and read back as
uint8 arrays, never converted to float. Only numpy and the standard library
are used.
"""

import json
import os
import struct

import numpy as np

ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "F8_E4M3": 1}


def f32_to_bf16_bits(a):
    """float32 array -> uint16 bfloat16 bit patterns, rounding to nearest even."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4")
    nan = np.isnan(a)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    bits = rounded.astype("<u2")
    if nan.any():
        bits[nan] = 0x7FC0
    return bits


def bf16_bits_to_f32(bits):
    """uint16 bfloat16 bit patterns -> float32 array (exact)."""
    return (bits.astype("<u4") << np.uint32(16)).view("<f4")


def encode(a, dtype):
    """float array -> little-endian array of the on-disk dtype."""
    if dtype == "F32":
        return np.ascontiguousarray(a, dtype="<f4")
    if dtype == "F16":
        return np.ascontiguousarray(a, dtype="<f4").astype("<f2")
    if dtype == "BF16":
        return f32_to_bf16_bits(a)
    if dtype in ("U8", "F8_E4M3"):  # raw bytes (F8_E4M3: the codes): the array must already hold integers 0..255
        a = np.asarray(a)
        if a.dtype != np.uint8:
            if not np.issubdtype(a.dtype, np.integer) or a.size and (a.min() < 0 or a.max() > 255):
                raise ValueError("U8 tensors want integers in 0..255, got %s" % a.dtype)
        return np.ascontiguousarray(a, dtype=np.uint8)
    raise ValueError("unsupported dtype %r" % dtype)


def decode(raw, dtype, shape):
    """bytes-like of the on-disk dtype -> float32 array of the given shape (U8: a uint8 array)."""
    if dtype == "F32":
        a = np.frombuffer(raw, dtype="<f4")
    elif dtype == "F16":
        a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dtype == "BF16":
        a = bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
    elif dtype in ("U8", "F8_E4M3"):  # F8_E4M3 too comes back as its byte codes
        a = np.frombuffer(raw, dtype=np.uint8)
    else:
        raise ValueError("unsupported dtype %r" % dtype)
    return a.reshape(shape)


def write(path, tensors, dtype="F32", metadata=None):
    """Write tensors, a list of (name, float array), all stored as dtype, or
    (name, array, dtype) to store that one as its own dtype (e.g. "U8").

    The header is padded with spaces so the data section starts 8-byte aligned.
    Tensors are laid out back to back in the order given (no holes).
    """
    encoded = [(t[0], encode(t[1], t[2] if len(t) > 2 else dtype), t[2] if len(t) > 2 else dtype)
               for t in tensors]
    header = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, e, dt in encoded:
        header[name] = {
            "dtype": dt,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((8 - (8 + len(hbytes)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for _, e, _ in encoded:
            f.write(memoryview(e.reshape(-1)).cast("B"))
    return offset


def read_header(path):
    """-> (header dict without __metadata__, metadata dict, data section start)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("%s: too short for a safetensors file" % path)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 1024 * 1024:
            raise ValueError("%s: bad header length %d" % (path, n))
        header = json.loads(f.read(n).decode("utf-8"))
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    data_size = size - data_start
    for name, info in header.items():
        dtype = info["dtype"]
        if dtype not in ITEM_SIZE:
            raise ValueError("%s: tensor %s has unsupported dtype %s" % (path, name, dtype))
        begin, end = info["data_offsets"]
        count = 1
        for d in info["shape"]:
            count *= d
        if not (0 <= begin <= end <= data_size) or end - begin != count * ITEM_SIZE[dtype]:
            raise ValueError("%s: tensor %s has bad offsets %r" % (path, name, info["data_offsets"]))
    return header, metadata, data_start


def read(path):
    """-> (dict name -> float32 numpy array (U8: uint8), dict name -> dtype string, metadata)."""
    header, metadata, data_start = read_header(path)
    with open(path, "rb") as f:
        f.seek(data_start)
        data = f.read()
    out = {}
    dtypes = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = decode(data[begin:end], info["dtype"], info["shape"])
        dtypes[name] = info["dtype"]
    return out, dtypes, metadata


def read_model_dir(model_dir):
    """Read model.safetensors, or every shard listed in model.safetensors.index.json."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = ["model.safetensors"]
    tensors = {}
    dtypes = {}
    for fname in files:
        t, d, _ = read(os.path.join(model_dir, fname))
        for name in t:
            if name in tensors:
                raise ValueError("tensor %s appears in more than one file" % name)
            if weight_map is not None and weight_map.get(name) != fname:
                raise ValueError("tensor %s is in %s but the index says %s"
                                 % (name, fname, weight_map.get(name)))
        tensors.update(t)
        dtypes.update(d)
    if weight_map is not None:
        missing = set(weight_map) - set(tensors)
        if missing:
            raise ValueError("index lists tensors missing from the shards: %s" % sorted(missing)[:5])
    return tensors, dtypes
