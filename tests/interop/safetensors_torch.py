"""The checkpoint sample (tests/interop/safetensors_io.py) through torch and the safetensors package:
the python side of tests/test_interop_torch_current.sh's checkpoint part (needs torch and the `safetensors`
package, e.g. Debian's python3-safetensors; tests/interop/safetensors_check.py is the reader that needs
neither).

    safetensors_torch.py read FILE      FILE (written by ddp.h) loads with safetensors.torch.load_file:
                                        every name, torch dtype, shape, value (-0.0's sign, +inf, int64
                                        exactly) and byte equals the sample; each tensor's ddp.crc32c
                                        checksum matches its bytes as torch holds them; the other metadata
                                        (safe_open(...).metadata()) equals safetensors_io.META
    safetensors_torch.py write FILE [--no-checksums]
                                        the sample as torch tensors made from its values, saved with
                                        safetensors.torch.save_file (the package's own layout: data sorted
                                        by alignment then name, compact JSON), with safetensors_io.META
                                        and, unless --no-checksums, one ddp.crc32c key per tensor
Exit 0 when everything matches; any difference raises with the tensor's name."""
import math
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import safetensors_io as st

TORCH = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
         "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
FLOATS = ("F32", "F64", "F16", "BF16")


def tensor_bytes(t):
    """The tensor's elements as little-endian bytes, as torch holds them (x86: native = little)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_values(k, dtype, shape):
    """Sample tensor k built by torch from its values (f64 or i64, then converted: exact for the sample)."""
    n = math.prod(shape)
    vals = [st.sample_value(k, dtype, i) for i in range(n)]
    wide = torch.tensor(vals, dtype=torch.float64 if dtype in FLOATS else torch.int64)
    return wide.to(TORCH[dtype]).reshape(shape)


def check_read(path):
    tensors = load_file(path)  # the package checks the layout (offsets, gaps, overlaps, sizes)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    expected = st.sample_tensors()
    names = [name for name, _, _, _ in expected]
    assert sorted(tensors) == sorted(names), "names: %s, expected %s" % (sorted(tensors), sorted(names))
    for k, (name, dtype, shape, raw) in enumerate(expected):
        t = tensors[name]
        assert t.dtype == TORCH[dtype], "%r: torch dtype %s, expected %s" % (name, t.dtype, TORCH[dtype])
        assert tuple(t.shape) == tuple(shape), "%r: shape %s, expected %s" % (name, tuple(t.shape), shape)
        want = from_values(k, dtype, shape)
        if dtype in FLOATS:  # compare in f64: exact for these values; inf == inf; -0.0 == 0.0 (sign below)
            assert torch.equal(t.double(), want.double()), "%r: values %s, expected %s" % (name, t, want)
            if t.numel() > 2:
                assert bool(torch.signbit(t.reshape(-1)[2])), "%r: -0.0 lost its sign" % name
        else:
            assert t.reshape(-1).tolist() == want.reshape(-1).tolist(), "%r: values %s, expected %s" % (name, t, want)
        got = tensor_bytes(t)
        assert got == raw, "%r: bytes differ from the sample" % name
        crc = meta.get("ddp.crc32c." + name)
        assert crc is not None, "no ddp.crc32c checksum for %r" % name
        assert int(crc, 16) == st.crc32c(got), "%r: checksum %s, torch's bytes give %08x" % (name, crc, st.crc32c(got))
    user = {k: v for k, v in meta.items() if not k.startswith("ddp.crc32c.")}
    assert user == st.META, "metadata: %r, expected %r" % (user, st.META)
    print("torch %s + safetensors read %s: %d tensors, %d checksums and %d metadata keys equal"
          % (torch.__version__, path, len(tensors), len(meta) - len(user), len(user)))


def write(path, checksums):
    tensors = {}
    meta = dict(st.META)
    for k, (name, dtype, shape, raw) in enumerate(st.sample_tensors()):
        t = from_values(k, dtype, shape)
        assert tensor_bytes(t) == raw, "%r: torch's conversion of the sample differs from its bytes" % name
        tensors[name] = t
        if checksums:
            meta["ddp.crc32c." + name] = "%08x" % st.crc32c(raw)
    save_file(tensors, path, metadata=meta)
    print("torch %s + safetensors wrote %s (%s)" % (torch.__version__, path,
                                                   "with checksums" if checksums else "no checksums"))


def main():
    cmd = sys.argv[1]
    if cmd == "read":
        check_read(sys.argv[2])
    elif cmd == "write":
        write(sys.argv[2], "--no-checksums" not in sys.argv)
    else:
        sys.exit("unknown command " + cmd)


if __name__ == "__main__":
    main()
