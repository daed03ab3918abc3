"""A toy parallel mode, the whole of it but its registry entry (tests/test_registry.py adds
that): `gradient_scale=s` multiplies each step's gradients by s before the update. What a
mode is: docs/develop/testing.md, "How to add a mode"."""

from __future__ import annotations

import tfdist


class GradientScale(tfdist.StepHook):
    """Each gradient times `scale`, between the step's gradients and its update."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    @property
    def name(self) -> str:
        return f"gradient_scale={self.scale:g}"

    def apply(self, grads_and_vars, apply_next):
        return apply_next([(g if g is None else g * self.scale, v) for g, v in grads_and_vars])
