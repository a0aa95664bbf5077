"""Orthogonal matrices for rotations: Hadamard matrices of the sizes models use, and random ones.

A Hadamard matrix of order ``n`` (entries +-1, ``H @ H.T == n I``) exists for the orders that
transformer widths have in practice, but Sylvester's doubling alone gives only powers of two. Widths
such as 576 (SmolLM2), 640 (gemma-3-270m), 896 (Qwen2.5-0.5B) or 1536 are ``2**k * m`` with ``m`` one
of the orders Paley's constructions give from a prime ``q``: ``q + 1`` when ``q % 4 == 3`` (Paley I),
``2 (q + 1)`` when ``q % 4 == 1`` (Paley II). :func:`hadamard` finds such a factorization and builds
the Kronecker product; :func:`orthogonal` returns the matrix a rotation uses: the Hadamard matrix
with random column signs (QuaRot's randomized Hadamard) scaled to be orthonormal, or a random
orthogonal matrix (Haar, from a QR decomposition). Everything is float64: the caller rotates in
float64 and rounds once.
"""

from __future__ import annotations

from functools import cache

import numpy as np

MODES = ("hadamard", "random")


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """The q x q matrix Q[i, j] = chi(j - i) of the quadratic character of GF(q), q prime."""
    squares = np.zeros(q, dtype=bool)
    squares[(np.arange(1, q) ** 2) % q] = True
    chi = np.where(squares, 1, -1).astype(np.int64)
    chi[0] = 0
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> np.ndarray:
    """Order q + 1, q prime with q % 4 == 3."""
    jac = _jacobsthal(q)
    s = np.zeros((q + 1, q + 1), dtype=np.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return s + np.eye(q + 1, dtype=np.int64)


def _paley2(q: int) -> np.ndarray:
    """Order 2 (q + 1), q prime with q % 4 == 1."""
    jac = _jacobsthal(q)
    c = np.zeros((q + 1, q + 1), dtype=np.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = jac
    a = np.array([[1, -1], [-1, -1]], dtype=np.int64)
    b = np.array([[1, 1], [1, -1]], dtype=np.int64)
    out = np.zeros((2 * (q + 1), 2 * (q + 1)), dtype=np.int64)
    for i in range(q + 1):
        for j in range(q + 1):
            out[2 * i:2 * i + 2, 2 * j:2 * j + 2] = b if c[i, j] == 0 else c[i, j] * a
    return out


@cache
def _base(m: int) -> np.ndarray | None:
    """A Hadamard matrix of order m from Paley's constructions (or 1, 2), or None."""
    if m == 1:
        return np.ones((1, 1), dtype=np.int64)
    if m == 2:
        return np.array([[1, 1], [1, -1]], dtype=np.int64)
    if m % 4:
        return None
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley1(m - 1)
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley2(m // 2 - 1)
    return None


def hadamard_order_parts(n: int) -> tuple[int, int] | None:
    """``(m, 2**k)`` with ``m * 2**k == n`` and a known Hadamard matrix of order m, or None."""
    if n < 1:
        return None
    power = 1
    while n % (power * 2) == 0:
        power *= 2
    while power >= 1:
        m = n // power
        if _base(m) is not None:
            return m, power
        power //= 2
    return None


def hadamard(n: int) -> np.ndarray:
    """A Hadamard matrix of order n (entries +-1, float64); ValueError when no construction is known."""
    parts = hadamard_order_parts(n)
    if parts is None:
        raise ValueError(f"no Hadamard matrix of order {n} is known to bitpress (orders 2**k * m, m from Paley's "
                         "constructions)")
    m, power = parts
    out = _base(m).astype(np.float64)
    sylvester = np.array([[1.0]])
    h2 = np.array([[1.0, 1.0], [1.0, -1.0]])
    while sylvester.shape[0] < power:
        sylvester = np.kron(sylvester, h2)
    return np.kron(out, sylvester)


def orthogonal(n: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    """An n x n orthonormal float64 matrix: randomized Hadamard (``hadamard``) or Haar random (``random``)."""
    if mode == "hadamard":
        signs = rng.choice(np.array([-1.0, 1.0]), size=n)
        return hadamard(n) * signs[None, :] / np.sqrt(n)
    if mode == "random":
        q, r = np.linalg.qr(rng.standard_normal((n, n)))
        return q * np.sign(np.diag(r))[None, :]
    raise ValueError(f"rotate_mode must be one of {', '.join(MODES)}, got {mode!r}")
