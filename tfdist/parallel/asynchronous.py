"""Corrections for asynchronous parameter-server training, as hooks on its step.

In parameter-server training each worker reads the weights, computes a gradient and applies
it while the others do the same: by the time a gradient reaches the weights, other updates
have moved them (its staleness, tau; tfdist/training/staleness.py counts it). Three remedies
from the literature, each a StepHook the parameter_server runner calls at the points of its
step (tfdist.training.hooks.AsyncStep):

- DelayCompensation (`async_correction="dc"`; Zheng et al., 2017, "Asynchronous stochastic
  gradient descent with delay compensation"): a stale gradient g, computed at the weights
  w_read the step read, is corrected towards the gradient at the weights w_now it is applied
  to by a first-order Taylor term whose Hessian is approximated by g*g:
      g + lambda * g * g * (w_now - w_read)
  computed on the ps, beside each variable, from the values the step read. The adaptive form
  (DC-ASGD-a, the default) divides lambda by the root of a moving mean square of g.
- MomentumCorrection (`async_correction="momentum"`; Mitliagkas et al., 2016, "Asynchrony
  begets momentum"): asynchrony acts as an implicit momentum of about 1 - 1/(1 + mean tau)
  (1 - 1/workers when all workers are in flight), so the explicit momentum is lowered by
  it: SGD's momentum mu becomes max(0, mu - implicit), from the staleness measured so far.
- BoundedStaleness (`max_staleness=s`; the bounded-delay consistency of Li et al., 2014,
  "Scaling distributed machine learning with the parameter server", a form of
  stale-synchronous parallel): steps take tickets in the order the coordinator schedules
  them; step t reads the weights only once the updates of steps before t - s are written,
  and its update is applied after step t - 1's. No update is then more than s updates stale:
  s = 0 is sequentially consistent (staleness 0, the workers take turns), and larger s lets
  up to s + 1 steps compute at once.
- StalenessAwareRate (`staleness_aware_lr=True`; Zhang et al., 2016, "Staleness-aware
  Async-SGD for distributed deep learning"): each update's learning rate is divided by
  max(1, tau), so a gradient computed from old weights moves them less
  (tfdist/training/staleness.py's StalenessAwareSchedule, scaled per update by the runner).
- SynchronousWarmup (`async_warmup=n`): the first n steps take turns as under
  `max_staleness=0`, then the updates go through as asynchronously as the bound allows. A
  network's first steps are where staleness costs most: SGD with momentum that leaves a
  plateau synchronously can fail to leave it with stale updates (tools/exchange_bench), and
  the warm-up pays the turns' price only while it lasts.

Example:

    tfdist.fit(model, data, steps_per_epoch=100, async_correction="dc", max_staleness=2)
"""

from __future__ import annotations

import logging

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.training.hooks import AsyncStep, StepHook
from tfdist.training.job import Job
from tfdist.training.staleness import StalenessAwareSchedule

log = logging.getLogger(__name__)


class AsyncCorrectionError(FitError):
    """An asynchronous correction cannot work with this model or optimizer as asked."""


def _resources(variable) -> list[tf.Variable]:
    """The TensorFlow variables behind a Keras variable (its shards, where split)."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return list(getattr(value, "variables", [value]))


def _resource(variable) -> tf.Variable:
    return variable.value if isinstance(variable, keras.Variable) else variable


class DelayCompensation(StepHook):
    """Delay-compensated ASGD: each stale gradient corrected on the ps (see the module).

    Args:
      lam: lambda, the correction's strength (lambda_0 of the adaptive form).
      adaptive: divide lambda by the root of each weight's moving mean square of g
        (DC-ASGD-a); False uses lambda as given (DC-ASGD-c).
      decay: the moving mean square's decay (m in the paper).
      epsilon: added to the root of the mean square.
    """

    asynchronous_only = True

    def __init__(
        self,
        lam: float | None = None,
        *,
        adaptive: bool = True,
        decay: float = 0.95,
        epsilon: float = 1e-7,
    ):
        # The paper's values for CIFAR-10: lambda_0 = 2 adaptive, lambda = 0.04 constant.
        self.lam = float(lam if lam is not None else (2.0 if adaptive else 0.04))
        if self.lam < 0:
            raise AsyncCorrectionError(f"lam must be >= 0. Received: lam={lam!r}")
        self.adaptive, self.decay, self.epsilon = adaptive, float(decay), float(epsilon)
        self.mean_squares: dict[int, tf.Variable] = {}
        self._read: dict[int, tf.Tensor] = {}
        self._ticket = None

    @property
    def name(self) -> str:
        return "async_correction='dc'"

    def build(self, model: keras.Model, job: Job) -> None:
        if self.already_built(model, job):
            return  # a later fit of a kept engine: its traced steps hold these variables
        strategy = job.strategy
        self.mean_squares = {}
        self._variables = [r for v in model.trainable_variables for r in _resources(v)]
        if not self.adaptive:
            return
        for variable in model.trainable_variables:
            for resource in _resources(variable):
                with strategy.extended.colocate_vars_with(resource):
                    self.mean_squares[id(resource)] = tf.Variable(
                        tf.zeros(resource.shape, resource.dtype),
                        trainable=False,
                        name="dc_mean_square",
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    )

    def begin_step(self, step: AsyncStep) -> list[tf.Tensor]:
        # The weights as the step reads them, kept where they live (no copy leaves the ps).
        self._read, self._ticket = {}, step.ticket
        for resource in self._variables:
            with tf.device(resource.device):
                self._read[id(resource)] = tf.identity(resource.read_value())
        return list(self._read.values())

    def correct(self, grad, resource, read) -> tf.Tensor | tf.IndexedSlices:
        """`grad` corrected for the weights having moved from `read` to their value now."""
        now = resource.read_value()
        if isinstance(grad, tf.IndexedSlices):
            rows = grad.values
            moved = tf.gather(now, grad.indices) - tf.gather(read, grad.indices)
            scale = self._rate(rows, resource, grad.indices)
            return tf.IndexedSlices(
                rows + scale * rows * rows * moved, grad.indices, grad.dense_shape
            )
        grad = tf.convert_to_tensor(grad)
        return grad + self._rate(grad, resource) * grad * grad * (now - read)

    def _rate(self, grad, resource, indices=None):
        if not self.adaptive:
            return tf.cast(self.lam, grad.dtype)
        mean_square = self.mean_squares[id(resource)]
        if indices is None:
            updated = self.decay * mean_square + (1 - self.decay) * grad * grad
            mean_square.assign(updated)
        else:
            updated = self.decay * tf.gather(mean_square, indices) + (1 - self.decay) * grad * grad
            mean_square.scatter_update(tf.IndexedSlices(updated, indices))
        # Bias-corrected, as Adam corrects its moments: a mean of few squares is not small.
        steps = tf.cast(self._ticket + 1, grad.dtype)
        unbiased = updated / (1 - tf.pow(tf.cast(self.decay, grad.dtype), steps))
        return self.lam / (tf.sqrt(unbiased) + self.epsilon)

    def apply(self, grads_and_vars, apply_next):
        corrected = []
        for grad, variable in grads_and_vars:
            resource = _resource(variable)
            read = self._read.get(id(resource))
            if grad is not None and read is not None:
                with tf.device(resource.device):
                    grad = self.correct(grad, resource, read)
            corrected.append((grad, variable))
        return apply_next(corrected)


class MomentumCorrection(StepHook):
    """SGD's momentum lowered by the implicit momentum of asynchrony (see the module).

    The implicit momentum is 1 - 1/(1 + mean staleness), the mean over the recent updates
    (a moving mean over about `window` of them); each step applies SGD with momentum
    max(0, mu - implicit), by scaling its momentum slot before Keras's update (exact for
    SGD: v <- mu * (scaled v) - lr * g). Logged at each epoch's end.

    Args:
      window: about how many recent updates the mean staleness covers.
    """

    asynchronous_only = True

    def __init__(self, *, window: int = 100):
        self.window = window
        self._step: AsyncStep | None = None

    @property
    def name(self) -> str:
        return "async_correction='momentum'"

    def build(self, model: keras.Model, job: Job) -> None:
        optimizer = model.optimizer
        if not isinstance(optimizer, keras.optimizers.SGD) or not optimizer.momentum:
            raise AsyncCorrectionError(
                "async_correction='momentum' lowers SGD's momentum by the momentum asynchrony "
                "adds; it needs keras.optimizers.SGD with momentum > 0 (for Adam and others, "
                "use async_correction='dc'). Received: "
                f"{type(optimizer).__name__}"
                + (f"(momentum={optimizer.momentum})" if hasattr(optimizer, "momentum") else "")
            )
        if optimizer.nesterov:
            raise AsyncCorrectionError(
                "async_correction='momentum' lowers SGD's momentum through its slot, which "
                "Nesterov's update also reads with the full momentum. Use nesterov=False. "
                "Received: nesterov=True"
            )
        self.optimizer, self.is_chief = optimizer, job.is_chief
        self.momentum = float(optimizer.momentum)
        with job.strategy.scope():
            self.mean_staleness = tf.Variable(
                0.0, trainable=False, name="mean_staleness",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )  # fmt: skip
            self.updates = tf.Variable(
                0.0, trainable=False, name="corrected_updates",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )  # fmt: skip

    def explicit(self, mean_staleness):
        """The momentum SGD applies, given the mean staleness: max(0, mu - implicit)."""
        implicit = 1.0 - 1.0 / (1.0 + mean_staleness)
        return tf.maximum(0.0, self.momentum - implicit)

    def begin_step(self, step: AsyncStep) -> list[tf.Tensor]:
        self._step = step
        return []

    def apply(self, grads_and_vars, apply_next):
        tau = self._step.staleness
        count = self.updates.assign_add(1.0)
        weight = tf.maximum(1.0 / count, 1.0 / self.window)
        mean = self.mean_staleness.assign_add((tau - self.mean_staleness) * weight)
        # Keras's update is v <- mu v - lr g: v scaled by explicit / mu first makes it
        # v <- explicit v - lr g.
        ratio = self.explicit(mean) / self.momentum
        scaled = []
        for grad, variable in grads_and_vars:
            if grad is not None:
                slot = compat.momentum_slot(self.optimizer, variable)
                scaled.append(slot.assign(slot * tf.cast(ratio, slot.dtype)))
        with tf.control_dependencies(scaled):
            return apply_next(list(grads_and_vars))

    def settle(self) -> None:
        if not self.is_chief:
            return
        mean = float(self.mean_staleness.numpy())
        log.info(
            "%s: mean staleness %.2f, so asynchrony adds momentum %.2f; SGD's momentum "
            "%.2f is applied as %.2f",
            self.name, mean, 1 - 1 / (1 + mean), self.momentum, float(self.explicit(mean)),
        )  # fmt: skip

    def summary(self) -> dict[str, float | int | None]:
        mean = float(self.mean_staleness.numpy())
        return {"momentum_applied": float(self.explicit(mean)), "momentum_asked": self.momentum}


class StalenessAwareRate(StepHook):
    """`staleness_aware_lr=True`: each update's learning rate divided by max(1, its
    staleness) (Zhang et al., 2016). The optimizer's rate is wrapped in a
    StalenessAwareSchedule (once: a second fit finds it wrapped), which the parameter_server
    runner scales around each update."""

    asynchronous_only = True

    def __init__(self, on: bool = True):
        self.on = on

    @property
    def name(self) -> str:
        return "staleness_aware_lr"

    def build(self, model: keras.Model, job: Job) -> None:
        optimizer = model.optimizer
        rate = compat.learning_rate_schedule(optimizer)
        if isinstance(rate, StalenessAwareSchedule):
            return
        if not isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))  # a plain rate
        optimizer.learning_rate = StalenessAwareSchedule(rate)


class BoundedStaleness(StepHook):
    """No update more than `max_staleness` updates stale (see the module).

    Args:
      max_staleness: s >= 0; 0 makes every update apply to the weights it was computed from.
      timeout_seconds: how long a step waits for the steps before it; after that it goes on
        and the summary counts it. A lost worker's steps run again elsewhere once a worker
        is free, so a failure holds the others up for about this long.
      poll_microseconds: how often a waiting step looks again.
    """

    asynchronous_only = True

    def __init__(
        self, max_staleness: int, *, timeout_seconds: float = 10.0, poll_microseconds: int = 200
    ):
        if (
            not isinstance(max_staleness, int)
            or isinstance(max_staleness, bool)
            or max_staleness < 0
        ):
            raise AsyncCorrectionError(
                f"max_staleness must be a whole number >= 0. Received: {max_staleness!r}"
            )
        self.max_staleness, self.timeout_seconds = max_staleness, float(timeout_seconds)
        self.poll_microseconds = poll_microseconds
        self._step: AsyncStep | None = None

    @property
    def name(self) -> str:
        return f"max_staleness={self.max_staleness}"

    def build(self, model: keras.Model, job: Job) -> None:
        if self.already_built(model, job):
            return  # a later fit of a kept engine: its traced steps hold these variables
        with job.strategy.scope():
            # The steps whose updates are written, in ticket order, and the waits that ended
            # by the timeout.
            self.written = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="written_updates",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )  # fmt: skip
            self.timeouts = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="staleness_timeouts",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )  # fmt: skip

    def start(self) -> None:
        # Each call's tickets count from 0.
        self.written.assign(0)
        self.timeouts.assign(0)

    def begin_step(self, step: AsyncStep) -> list[tf.Tensor]:
        self._step = step
        return [self._wait_for(step.ticket - self.max_staleness)]

    def before_update(self, step: AsyncStep) -> list[tf.Tensor]:
        return [self._wait_for(step.ticket)]

    def apply(self, grads_and_vars, apply_next):
        # The runner's claim of this update (after its turn came) is ahead in the chain, and
        # the update runs after it.
        result = apply_next(list(grads_and_vars))
        # Written once every variable's update has run (ops on one variable run in order)
        # and the update is counted: a step that waits for it then reads a counter that
        # holds it, so its staleness stays within the bound.
        done = [
            tf.raw_ops.VarIsInitializedOp(resource=_resource(v).handle)
            for g, v in grads_and_vars
            if g is not None
        ]
        done += [self._step.staleness, *([result] if tf.is_tensor(result) else [])]
        with tf.control_dependencies(done):
            self.written.assign(tf.maximum(self.written.read_value(), self._step.ticket + 1))
        return result

    def _wait_for(self, target: tf.Tensor) -> tf.Tensor:
        """Waits until `target` updates are written (or the timeout); returns when done."""
        written = self.written

        def wait():
            start = tf.timestamp()
            pause = iter(_pauses(self.poll_microseconds))

            def waiting(_):
                return tf.logical_and(
                    written.read_value() < target, tf.timestamp() - start < self.timeout_seconds
                )

            (polls,) = tf.while_loop(
                waiting, lambda i: [i + next(pause)], [tf.constant(0, tf.int64)]
            )
            with tf.control_dependencies([polls]):
                late = written.read_value() < target
            return tf.cond(
                late, lambda: self.timeouts.assign_add(1), lambda: tf.constant(0, tf.int64)
            )

        return tf.cond(written.read_value() >= target, lambda: tf.constant(0, tf.int64), wait)

    def summary(self) -> dict[str, float | int | None]:
        return {
            "max_staleness": self.max_staleness,
            "staleness_timeouts": int(self.timeouts.numpy()),
        }


class SynchronousWarmup(BoundedStaleness):
    """The first `steps` updates take turns (staleness 0), the later ones do not wait.

    With `max_staleness` as well, that bound holds after the warm-up (the two hooks wait
    each on its own count of written updates).

    Args:
      steps: how many steps (counted over the run, across its epochs) take turns.
      timeout_seconds, poll_microseconds: as BoundedStaleness.
    """

    def __init__(self, steps: int, *, timeout_seconds: float = 10.0, poll_microseconds: int = 200):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise AsyncCorrectionError(
                f"async_warmup must be a whole number of steps >= 1. Received: {steps!r}"
            )
        super().__init__(0, timeout_seconds=timeout_seconds, poll_microseconds=poll_microseconds)
        self.steps = steps

    @property
    def name(self) -> str:
        return f"async_warmup={self.steps}"

    def _target(self, ticket) -> tf.Tensor:
        # After the warm-up, a target of 0 written updates, which never waits.
        return tf.where(ticket < self.steps, ticket, tf.zeros_like(ticket))

    def begin_step(self, step: AsyncStep) -> list[tf.Tensor]:
        self._step = step
        return [self._wait_for(self._target(step.ticket))]

    def before_update(self, step: AsyncStep) -> list[tf.Tensor]:
        return [self._wait_for(self._target(step.ticket))]

    def summary(self) -> dict[str, float | int | None]:
        return {"async_warmup": self.steps, "warmup_timeouts": int(self.timeouts.numpy())}


def _pauses(microseconds: int) -> tf.data.Dataset:
    """A dataset of ones, each taking `microseconds` to produce: a wait inside a graph that
    runs on a worker server, where Python (time.sleep) is not there to call."""
    ones = tf.data.Dataset.from_tensors(tf.constant(1, tf.int64)).repeat()
    slow = tf.raw_ops.SleepDataset(
        input_dataset=tf.data.experimental.to_variant(ones),
        sleep_microseconds=tf.constant(microseconds, tf.int64),
        output_types=[tf.int64],
        output_shapes=[tf.TensorShape([])],
    )
    return tf.data.experimental.from_variant(slow, ones.element_spec)


ASYNC_CORRECTIONS = {"dc": DelayCompensation, "momentum": MomentumCorrection}


def correction(name: str) -> StepHook:
    """The correction `async_correction=name` asks for (the registry's builder)."""
    if name not in ASYNC_CORRECTIONS:
        raise AsyncCorrectionError(
            f"async_correction takes one of {', '.join(ASYNC_CORRECTIONS)} (or None). "
            f"Received: async_correction={name!r}"
        )
    return ASYNC_CORRECTIONS[name]()
