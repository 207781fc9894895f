"""Shared test fixtures (small on purpose): deterministic seeding and a Hypothesis profile.

Other test modules may import from here read-only (``from tests.conftest import ...``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

# The CI machine has 2 shared cores: wall times are noisy, so no per-example deadline.
settings.register_profile(
    "sublayer", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("sublayer")

SEED = 0


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same global RNG state (torch's CPU generator)."""
    torch.manual_seed(SEED)


@pytest.fixture(autouse=True)
def _switches():
    """Every test leaves the kernels' and the fast decoding's switches as it found them (a test that switches one off
    and back on must not turn on what ``SUBLAYER_KERNELS=0`` or ``SUBLAYER_DECODING=0`` switched off for the run)."""
    from sublayer import kernels
    from sublayer.runtime import causal

    was = kernels.switched_on(), causal.enabled()
    yield
    kernels.set_enabled(was[0])
    causal.set_enabled(was[1])


def grads(*tensors: torch.Tensor) -> list[torch.Tensor | None]:
    """The ``.grad`` of each tensor (parameters or leaf inputs), for side-by-side comparisons."""
    return [t.grad for t in tensors]


def reference_decoding(fn):
    """``fn()`` with the fast decoding path switched off (generate / translate take their reference loops)."""
    from sublayer.models import decoding

    decoding.set_enabled(False)
    try:
        return fn()
    finally:
        decoding.set_enabled(True)


class LossForward(torch.nn.Module):
    """``model.loss`` as a module's forward, for ``torch.func.functional_call`` (gradchecks of a model's loss)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model.loss(*args, **kwargs)
