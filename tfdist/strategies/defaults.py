"""What 'auto' means for the settings whose best value depends on the hardware.

Explicit settings stay explicit (a number, a dtype policy); binaries and notebooks that offer
"auto" resolve it here, once the strategy is built:

    >>> strategy = tfdist.build_strategy("auto")
    >>> model.compile(..., steps_per_execution=auto_steps_per_execution(strategy))
    >>> keras.mixed_precision.set_dtype_policy(auto_mixed_precision(strategy) or "float32")

What a parallel mode's 'auto' means depends on the runner that trains, not on the hardware:
`tfdist.training.runners.mode_defaults(strategy)` answers that.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.strategies.tpu import runs_on_tpu

AUTO = "auto"
# Every tf.function call costs the TPU a round trip to its host, long against a small model's
# step on a TPU core, so a TPU runs many steps per call. 32 hides the round trip for small
# models while keeping progress, preemption and checkpoint checks a few seconds apart; the
# trainer never runs past an epoch's end, so short epochs simply run whole.
TPU_STEPS_PER_EXECUTION = 32


def auto_steps_per_execution(strategy: tf.distribute.Strategy | str) -> int:
    """Training steps per tf.function call: TPU_STEPS_PER_EXECUTION on a TPU, else 1.

    `strategy` is a strategy or its kind from tfdist.strategy_kind, e.g. 'tpu'.

    On CPUs and GPUs the host launches each step's kernels itself and the call overhead is
    small next to them; one step per call keeps every progress update current.
    """
    return TPU_STEPS_PER_EXECUTION if runs_on_tpu(strategy) else 1


def auto_mixed_precision(strategy: tf.distribute.Strategy | str) -> str | None:
    """'mixed_bfloat16' on a TPU, else None (float32); `strategy` as above.

    TPU matrix units compute in bfloat16 natively, and bfloat16 keeps float32's exponent
    range, so it needs no loss scaling. GPUs are left at float32: float16 pays off only on
    tensor-core GPUs and needs loss scaling, a choice to make explicitly with
    mixed_precision='mixed_float16'; on CPUs either half type is usually slower.
    """
    return "mixed_bfloat16" if runs_on_tpu(strategy) else None


def needs_static_shapes(strategy: tf.distribute.Strategy | str) -> bool:
    """Whether every batch must have the same shape (XLA on TPU cores compiles a program per
    input shape): evaluation then pads its last batches instead of running short ones."""
    return runs_on_tpu(strategy)


__all__ = [
    "AUTO",
    "TPU_STEPS_PER_EXECUTION",
    "auto_mixed_precision",
    "auto_steps_per_execution",
    "needs_static_shapes",
]
