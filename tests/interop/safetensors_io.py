"""A safetensors reader and writer written from the format description alone (not the safetensors
package), plus the sample tensors that tests/test_interop_checkpoint.sh exchanges with ddp.h.

Format: 8-byte little-endian header length N; N bytes of UTF-8 JSON: {"__metadata__": {str: str},
"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}; then the data section,
raw little-endian, the tensors back to back (no gaps, no overlaps), offsets relative to its start.
ddp.h adds one metadata key per tensor, "ddp.crc32c.<name>": the CRC-32C of its bytes as 8 hex digits.

The core here needs only the standard library (the fuzz script seeds its corpus with it); numpy is used
by safetensors_check.py to compare values.
"""
import json
import math
import struct

DTYPE_SIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data):
    """CRC-32C (Castagnoli): reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283


def write_file(path, tensors, metadata, checksums=True, reverse_data=True):
    """tensors: list of (name, dtype, shape, raw little-endian bytes). The data section is laid out in
    reverse order of the list (so readers must follow data_offsets, not the header's key order)."""
    meta = dict(metadata)
    header = {}
    order = list(reversed(tensors)) if reverse_data else list(tensors)
    offset = 0
    for name, dtype, shape, raw in order:
        n = DTYPE_SIZE[dtype] * math.prod(shape)
        assert n == len(raw), (name, n, len(raw))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
        if checksums:
            meta["ddp.crc32c." + name] = "%08x" % crc32c(raw)
    ordered = {"__metadata__": meta}
    for name, _, _, _ in tensors:  # header keys in list order, data in reverse: both are legal
        ordered[name] = header[name]
    text = json.dumps(ordered, ensure_ascii=True).encode("utf-8")  # default separators: ", " and ": "
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, raw in order:
            f.write(raw)


def read_file(path):
    """Returns (metadata, {name: (dtype, shape, bytes)}). Checks the layout rules and the ddp.h
    checksums that are present; raises ValueError on anything malformed."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError("shorter than the length prefix")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > 100_000_000 or 8 + n > len(blob):
        raise ValueError("bad header length %d" % n)
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("__metadata__ must map strings to strings")
    spans = []
    out = {}
    for name, info in header.items():
        if set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError("tensor %r has keys %s" % (name, sorted(info)))
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_SIZE:
            raise ValueError("unknown dtype %r" % dtype)
        if end - begin != DTYPE_SIZE[dtype] * math.prod(shape):
            raise ValueError("tensor %r: offsets do not match shape and dtype" % name)
        spans.append((begin, end, name))
        out[name] = (dtype, tuple(shape), data[begin:end])
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError("gap or overlap before %r" % name)
        at = end
    if at != len(data):
        raise ValueError("data section has %d bytes, tensors cover %d" % (len(data), at))
    for name, (_, _, raw) in out.items():
        stored = meta.get("ddp.crc32c." + name)
        if stored is not None and int(stored, 16) != crc32c(raw):
            raise ValueError("tensor %r: checksum mismatch" % name)
    return meta, out


# ---- the sample exchanged with ddp.h (tests/interop/safetensors_helper.c computes the same) ----

SAMPLE = [  # name, dtype, shape
    ("f32", "F32", (3, 4)),
    ("f64", "F64", (5,)),
    ("f16", "F16", (2, 3)),
    ("bf16", "BF16", (7,)),
    ("i8", "I8", (300,)),
    ("u8", "U8", (2, 2, 2)),
    ("i32", "I32", (6,)),
    ("i64", "I64", (4,)),
    ("scalar", "F32", ()),
    ("empty", "F16", (0, 3)),
    ("unicode \u00e9 \u2713 \"q\"", "I32", (2,)),
    ("eight_d", "U8", (1, 2, 1, 2, 1, 2, 1, 2)),
]

META = {
    "ddp.step": "1234",
    "ddp.epoch": "3",
    "ddp.sampler_position": "96",
    "ddp.world_size": "4",
    "ddp.rng_state": "00ff10ab7f80",
    "ddp.sampler_global_position": "384",
    "note": "caf\u00e9 \"quoted\" back\\slash\n\ttab \u2713 \U0001F600",
    "empty value": "",
}


def sample_value(k, dtype, i):
    """Element i of sample tensor k: exact in every dtype (quarters in [-2.75, 2.75] for floats,
    with +inf at i == 1 and -0.0 at i == 2; wrapping patterns for integers)."""
    if dtype in ("F32", "F64", "F16", "BF16"):
        if i == 1:
            return math.inf
        if i == 2:
            return -0.0
        return ((i * 7 + k * 3) % 23 - 11) * 0.25
    if dtype == "I8":
        return (i * 37 + k) % 256 - 128
    if dtype == "U8":
        return (i * 37 + k) % 256
    if dtype == "I32":
        v = (i * 2654435761 + k) % 2**32
        return v - 2**32 if v >= 2**31 else v
    v = (i * 0x9E3779B97F4A7C15 + k) % 2**64
    return v - 2**64 if v >= 2**63 else v


def encode(dtype, v):
    if dtype == "F32":
        return struct.pack("<f", v)
    if dtype == "F64":
        return struct.pack("<d", v)
    if dtype == "F16":
        return struct.pack("<e", v)
    if dtype == "BF16":  # the top half of the f32 bits (exact: the values need no rounding)
        return struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0] >> 16)[:2]
    return struct.pack({"I8": "<b", "U8": "<B", "I32": "<i", "I64": "<q"}[dtype], v)


def sample_tensors():
    out = []
    for k, (name, dtype, shape) in enumerate(SAMPLE):
        raw = b"".join(encode(dtype, sample_value(k, dtype, i)) for i in range(math.prod(shape)))
        out.append((name, dtype, shape, raw))
    return out
