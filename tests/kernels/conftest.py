"""Fixtures for the kernel tests. Triton kernels run on the CPU through the interpreter, which
`triton.jit` reads when it decorates, so TRITON_INTERPRET is set here, before any test imports
them. It stays set for the session: triton itself imports modules lazily that assert the mode has
not changed since triton was imported. vLLM's CPU platform ignores it (it runs no Triton)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

_POISONS = ({"float": float("nan"), "int": 90, "bool": True},
            {"float": -7777.0, "int": -37, "bool": False})


def _fill(t: torch.Tensor, poison: dict) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.fill_(poison["bool"])
    return t.fill_(poison["float"] if t.is_floating_point() else poison["int"])


class _PoisonedTorch:
    """Stands in for `torch` inside the Triton wrappers: every fresh output comes pre-filled."""

    def __init__(self, poison: dict):
        self.poison = poison

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        return _fill(torch.empty(*args, **kwargs), self.poison)

    def empty_like(self, *args, **kwargs):
        return _fill(torch.empty_like(*args, **kwargs), self.poison)


def _bits(t):
    """A tensor whose equality is bitwise equality of `t` (NaN == NaN, -0.0 != +0.0)."""
    if t is None:
        return None
    return {torch.float32: lambda: t.view(torch.int32), torch.bfloat16: lambda: t.view(torch.int16),
            torch.float16: lambda: t.view(torch.int16)}.get(t.dtype, lambda: t)()


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.fixture
def kq_poisoned(monkeypatch):
    """run(fn, *args, **kwargs): runs a Triton-backed fn twice, outputs pre-filled with two
    different poisons; any element a kernel leaves unwritten differs between the runs."""
    import kernels.triton_matmul as tm
    import kernels.triton_quant as tq

    def run(fn, *args, **kwargs):
        outs = []
        for poison in _POISONS:
            monkeypatch.setattr(tq, "torch", _PoisonedTorch(poison))
            monkeypatch.setattr(tm, "torch", _PoisonedTorch(poison))
            outs.append(fn(*args, **kwargs))
        monkeypatch.setattr(tq, "torch", torch)
        monkeypatch.setattr(tm, "torch", torch)
        for a, b in zip(_flat(outs[0]), _flat(outs[1])):
            if a is not None:
                assert torch.equal(_bits(a), _bits(b)), f"{fn.__name__} left elements unwritten"
        return outs[0]

    return run


def _weight(n: int, k: int, group: int, dtype=torch.float32, seed: int = 0, qmax: float = 7.5):
    """Random [n, k] weight (never zeros) whose first rows hold the edge cases, one per row:
    all-equal positive, all-equal negative, one all-zero group, a huge outlier, +-0 mixed with a
    tiny value, tiny magnitudes (tiny scales), exact rounding ties (amax = qmax -> scale 1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01
    edges = [
        torch.full((k,), 0.3),
        torch.full((k,), -0.7),
        torch.cat([torch.zeros(group), torch.randn(k - group, generator=g)]),
        torch.cat([torch.tensor([1e30]), torch.randn(k - 1, generator=g)]),
        torch.tensor([0.0, -0.0] * (k // 2) + [0.0] * (k % 2)).index_fill_(0, torch.tensor([1]), 3e-3),
        torch.randn(k, generator=g) * 1e-30,
        (torch.arange(k) % 15 - 7 + 0.5).float().index_fill_(0, torch.arange(0, k, group), qmax),
    ]
    for i, row in enumerate(edges[:n]):
        w[i] = row
    return w.to(dtype)


@pytest.fixture
def kq_bits():
    return _bits


@pytest.fixture
def kq_weight():
    return _weight
