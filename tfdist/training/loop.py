"""The traced loop every runner's steps run in, written once (Keras has one
`make_train_function`): a call of up to n steps in one tf.function, the batches taken from the
iterator inside it, and a sample of the steps' phases timed.

A runner supplies its step (`StepLoop`): what one step does on a batch, what the steps carry
from one to the next (metric state, summed times), and optionally a cheaper step with no
marks in its graph for a call's steps but its last, and a last step that also returns what
the step returned (a model's own train_step, whose last return value gives the logs). The
traced functions are made once per kind of call and kept with the runner, which
training/kept.py keeps on the model across calls.

- A bounded call (the data holds its n steps): n - 1 steps in a tf.while_loop, then the
  call's last step, its clock started once the loop has ended. n is an argument: one graph
  for every n. A call of one step has no loop, which spares a small step the loop's cost.
- An unbounded call (data of unknown length): each step first asks whether there is a batch
  (every worker's distributed iterator agrees on the end), and the call ends where the data
  does.

Also here: the loops outside a trace (`each_batch`: a step a call, for a model's own step on
data of unknown length; `call_until_end`: calls of steps_per_execution steps until the data
ends).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tfdist.training.steps import traced

NO_LIMIT = 2**62  # steps: until the data ends


def asked_for(iterator, after=()):
    """(the next batch, when it was asked for: after `after`, the step before): the start of
    a timed step's input phase."""
    with tf.control_dependencies(list(after)):
        asked = tf.timestamp()
    with tf.control_dependencies([asked]):
        return next(iterator), asked


def until_end(iterator, n, step, state, *, timed: bool = False):
    """`state = step(batch, state)` on up to `n` batches, stopping where the data ends
    (every worker's distributed iterator agrees on the end), in one tf.while_loop.

    `timed`: `step(batch, asked, state)`, `asked` being when the batch was asked for.
    Returns (how many ran, the last state).
    """

    def body(done, more, state):
        asked = tf.timestamp() if timed else None
        with tf.control_dependencies([asked] if timed else []):
            batch = iterator.get_next_as_optional()
        more = batch.has_value()
        when = (asked,) if timed else ()
        state = tf.cond(more, lambda: step(batch.get_value(), *when, state), lambda: state)
        return done + tf.cast(more, done.dtype), more, state

    done, _, state = tf.while_loop(
        lambda done, more, _: tf.logical_and(more, done < n),
        body,
        (tf.zeros([], n.dtype), tf.constant(True), state),
    )
    return done, state


class StepLoop:
    """A runner's traced calls of steps; see the module docstring.

    Args:
      step: one timed step, `(batch, asked, carried) -> carried`; with `timed=False`,
        `(batch, carried) -> carried` (an evaluation's).
      start: `(*args) -> carried`, what the call's first step takes; `args` are what the call
        is given besides the iterator and n (a ticket, a metric state).
      untimed: `(batch, carried) -> carried`, a bounded call's steps but its last, with no
        marks in their graph (their control edges cost a small step more than they tell).
        None: every step is the timed `step`.
      last: `(batch, asked, carried) -> (carried, outputs)`, a bounded call's last step,
        which also returns what the step returned. None: `step`, returning no outputs.
      finish: `(done, carried, outputs, *args) -> result`, what the traced function returns
        (inside the trace); by default `(done, carried, outputs)`.
    """

    def __init__(
        self,
        step: Callable,
        *,
        start: Callable[..., Any] = lambda *args: (),
        untimed: Callable | None = None,
        last: Callable | None = None,
        finish: Callable | None = None,
        timed: bool = True,
    ):
        self._step, self._start, self._untimed, self._last = step, start, untimed, last
        self._finish = finish or (lambda done, carried, outputs, *args: (done, carried, outputs))
        self._timed = timed
        self._functions: dict[str, Any] = {}
        self._counts: dict[int, tf.Tensor] = {}

    def function(self, *, bounded: bool, single: bool = False):
        """The traced function of a call: `(iterator, n, *args) -> finish(...)`; a single
        step's (`single`, bounded) takes no n."""
        kind = "single" if single else "bounded" if bounded else "unbounded"
        if kind not in self._functions:
            make = {"single": self._single, "bounded": self._bounded, "unbounded": self._stream}
            self._functions[kind] = traced(make[kind]())
        return self._functions[kind]

    def __call__(self, iterator, n: int, *args, bounded: bool):
        """Runs a call of up to `n` steps here: what `finish` returns."""
        if bounded and n == 1:
            return self.function(bounded=True, single=True)(iterator, *args)
        return self.function(bounded=bounded)(iterator, self._count(n), *args)

    def _count(self, n: int) -> tf.Tensor:
        if n not in self._counts:  # made once: a constant per call costs a small step time
            self._counts[n] = tf.constant(n)
        return self._counts[n]

    def _last_step(self, iterator, carried, after):
        batch, asked = asked_for(iterator, after)
        if self._last is not None:
            return self._last(batch, asked, carried)
        return self._step(batch, asked, carried), None

    def _single(self):
        def call(iterator, *args):
            carried, outputs = self._last_step(iterator, self._start(*args), after=())
            return self._finish(tf.constant(1), carried, outputs, *args)

        return call

    def _bounded(self):
        def between(iterator, carried):
            if self._untimed is not None:
                return self._untimed(next(iterator), carried)
            return self._step(*asked_for(iterator), carried)

        def call(iterator, n, *args):
            n = tf.convert_to_tensor(n)
            ran, carried = tf.while_loop(
                lambda i, _: i < n - 1,
                lambda i, carried: (i + 1, between(iterator, carried)),
                (tf.zeros([], n.dtype), self._start(*args)),
            )
            # The last step's clock starts when the loop has ended (its count says so).
            carried, outputs = self._last_step(iterator, carried, after=[ran])
            return self._finish(n, carried, outputs, *args)

        return call

    def _stream(self):
        def call(iterator, n, *args):
            n = tf.convert_to_tensor(n)
            done, carried = until_end(
                iterator, n, self._step, self._start(*args), timed=self._timed
            )
            return self._finish(done, carried, None, *args)

        return call


def each_batch(iterator, n: int, call):
    """Calls `call(batch)` on up to `n` batches, a call each, asking for every batch first.

    For the user's own steps on data of unknown length, whose last return value gives the
    logs. Returns (batches taken, what the last call returned).
    """
    done, result = 0, None
    while done < n:
        batch = iterator.get_next_as_optional()  # every worker agrees on the end
        if not batch.has_value():
            break
        result = call(batch.get_value())
        done += 1
    return done, result


def call_until_end(call, model: keras.Model, steps: int | None) -> None:
    """Calls `call(n)` (which runs up to n steps and returns how many ran) for `steps` steps,
    steps_per_execution at a time, or until the data ends."""
    per_call = max(1, model.steps_per_execution)
    remaining = steps
    while remaining is None or remaining > 0:
        n = per_call if remaining is None else min(per_call, remaining)
        done = call(n)
        if remaining is not None:
            remaining -= done
        if done < n:
            break
