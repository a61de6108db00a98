"""The per-dataset checksum of vitgrid checkpoints, in numpy (the C++ side is src/io/checkpoint.cpp):

    checksum = sum over elements i (global row-major index) of mix64(i * 0x9E3779B97F4A7C15 ^ bits(x_i))
               modulo 2**64, bits = the raw IEEE pattern (uint32 for float32, uint64 for float64),
    mix64 = the splitmix64 finaliser (include/vitgrid/core/rng.h)."""
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(z):
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def checksum(array):
    """uint64 checksum of a float32 or float64 array (any shape), as stored in its attribute."""
    a = np.ascontiguousarray(array)
    if a.dtype == np.float32:
        bits = a.reshape(-1).view(np.uint32).astype(np.uint64)
    elif a.dtype == np.float64:
        bits = a.reshape(-1).view(np.uint64)
    else:
        raise TypeError(f"checksum: float32 or float64 expected, got {a.dtype}")
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for start in range(0, bits.size, 1 << 22):  # bounded temporaries for large tensors
            idx = np.arange(start, min(start + (1 << 22), bits.size), dtype=np.uint64)
            h = _mix64((idx * _GOLDEN) ^ bits[start:start + idx.size])
            total = total + np.add.reduce(h, dtype=np.uint64)
    return int(total)
