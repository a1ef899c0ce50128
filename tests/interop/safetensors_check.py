"""Python side of tests/test_interop_checkpoint.sh.

    safetensors_check.py read FILE                 FILE (written by ddp.h) holds the sample: names,
                                                   dtypes, shapes, values (numpy), checksums, metadata
    safetensors_check.py write FILE [--no-checksums]   write the sample with safetensors_io's writer
    safetensors_check.py corrupt SRC DST           copy SRC flipping one bit of its last tensor byte
"""
import math
import sys

import numpy as np

import safetensors_io as st

NP = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I8": "i1", "U8": "u1", "I32": "<i4", "I64": "<i8"}


def to_numpy(dtype, shape, raw):
    """The tensor as a numpy array of its values (bf16 widened to f32 by putting its bits on top)."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=NP[dtype]).reshape(shape)


def check_read(path):
    meta, tensors = st.read_file(path)  # raises on a layout or checksum error
    expected = st.sample_tensors()
    names = [name for name, _, _, _ in expected]
    assert sorted(tensors) == sorted(names), "names: %s" % sorted(tensors)
    for k, (name, dtype, shape, raw) in enumerate(expected):
        got_dtype, got_shape, got_raw = tensors[name]
        assert got_dtype == dtype and got_shape == tuple(shape), (name, got_dtype, got_shape)
        assert "ddp.crc32c." + name in meta, "no checksum for %r" % name
        values = to_numpy(got_dtype, got_shape, got_raw)
        want = np.array([st.sample_value(k, dtype, i) for i in range(math.prod(shape))], dtype=np.float64)
        if dtype in ("I64",):  # compare 64-bit integers exactly, not through float64
            want_int = np.array([st.sample_value(k, dtype, i) for i in range(math.prod(shape))], dtype=np.int64)
            assert np.array_equal(values.reshape(-1), want_int), name
        else:
            assert np.array_equal(values.reshape(-1).astype(np.float64), want), (name, values, want)
        if dtype in ("F32", "F64", "F16", "BF16") and values.size > 2:
            assert np.signbit(values.reshape(-1)[2]), "%r: -0.0 lost its sign" % name
        assert got_raw == raw, "%r: bytes differ" % name
    user = {k: v for k, v in meta.items() if not k.startswith("ddp.crc32c.")}
    assert user == st.META, "metadata: %r" % user
    print("python read %s: %d tensors and %d metadata keys equal" % (path, len(tensors), len(user)))


def main():
    cmd = sys.argv[1]
    if cmd == "read":
        check_read(sys.argv[2])
    elif cmd == "write":
        st.write_file(sys.argv[2], st.sample_tensors(), st.META, checksums="--no-checksums" not in sys.argv)
        print("python wrote %s" % sys.argv[2])
    elif cmd == "corrupt":
        blob = bytearray(open(sys.argv[2], "rb").read())
        blob[-1] ^= 0x04
        open(sys.argv[3], "wb").write(blob)
    else:
        sys.exit("unknown command " + cmd)


if __name__ == "__main__":
    main()
