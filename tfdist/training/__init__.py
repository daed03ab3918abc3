"""The training engine behind `tfdist.fit`, and the seam new parallel modes plug into.

How a `tfdist.fit(model, data, ...)` call runs:

  fit.py          checks the call as Keras would (keywords, a compiled model made under the
                  strategy's scope, labels), turns the data into a FitData (fit_data.py),
                  picks a runner, builds it, and hands both to a Controller.
  runners/        one Runner per kind of strategy, in a registry keyed by
                  tfdist.strategy_kind (runners/__init__.py): SyncRunner (one_device,
                  mirrored, multi_worker_mirrored, tpu), CentralStorageRunner,
                  ParameterServerRunner. A runner owns every fact that depends on the
                  strategy: its iterators, the chief, the workers that move in lockstep and
                  how they agree (`agree(flag)`), building the model and optimizer, running n
                  steps, reading logs, evaluation, and turning a lost peer or parameter
                  server into one line naming the task (`explained()`).
  runner.py       the interfaces only: Runner, and StepHook.
  controller.py   Keras's fit loop (epochs, callbacks, validation, resuming mid-epoch from a
                  BackupAndRestore or tfdist checkpoint, the stop vote, SIGTERM -> back up at
                  this step and raise Preempted, the step-time report). It talks to a Runner
                  only and never asks which strategy it runs under.
  steps.py        the model's own train_step / test_step and their logs (Keras's rule), and
                  `updates_through`, which routes a step's optimizer update through the
                  StepHooks.
  step_times.py   where a step's time goes (input, compute, exchange), measured in the graph.

The step seam. Every step computes its gradients and then calls `optimizer.apply`; while a
step is traced, that call runs a chain of StepHooks, each of which may change the gradients
and hand them on (`apply_next`), hold them (accumulation), or apply them its own way
(sharded optimizer state, local SGD). The chain runs in replica context, once per replica
step, whether the step is Keras's `train_step`, the model's own override, or the
parameter-server runner's stateless step. A new parallel mode is one new file; two are
built so (tfdist/parallel/):

    class ShardedUpdate(tfdist.StepHook):            # zero.py: ZeRO stages 1 and 2
        synchronous_only = True                      # central_storage / ps refuse it

        def build(self, model, strategy):            # slices, and an optimizer per slice
            ...                                      # (the user's is built on nothing)

        def apply(self, grads_and_vars, apply_next):
            ...reduce-scatter, update this replica's slice, all-gather; no apply_next...

        def checkpoint_state(self):                  # the slices' slots, saved whole
            return {"sharded_optimizer_state": ...}

    class Accumulate(tfdist.StepHook):               # accumulate.py
        def step(self, batch, train_step):           # k micro-batches in one step
            ...train_step(micro) for each...

        def apply(self, grads_and_vars, apply_next):
            ...hold the first k-1, apply_next(the weighted sum) on the k-th...

    tfdist.fit(model, data, step_hooks=[Accumulate(4), ShardedUpdate(2)])
    # = tfdist.fit(model, data, accumulate_steps=4, shard_optimizer="zero2")

Local SGD and gossip (local_sgd.py, gossip.py) apply each replica's gradients with its own
optimizer copy and mix the weights after; their `settle()` (each epoch end, before a save)
makes the replicas one model. The parameter-server runner also calls a hook's
`begin_step(AsyncStep)` before a step reads the weights and `before_update(AsyncStep)`
before it counts and applies its update, with the step's ticket (its place in the
coordinator's order) and, for `apply`, its staleness: delay compensation remembers what was
read there, a staleness bound waits there (asynchronous.py; `asynchronous_only = True`).

A mode that changes the whole step rather than its update (pipeline stages with
micro-batches) is a Runner of its own, registered beside the others; the Controller runs it
unchanged.

Callbacks reach the runner too: a callback with a `set_runner(runner)` method is given the
runner before training, and may ask it who the chief is (`is_chief`), to settle the
variables before a save (`settle()`: every scheduled step applied, the replicas one model),
what else a checkpoint must hold (`checkpoint_state()`) and what it did (`summary()`).
tfdist's own StepCheckpoint (checkpoints.py) and RunRecord (report.py) are built so.

The rest of the package: the training binary's run (run.py: a zoo model, its data and
those callbacks handed to tfdist.fit), its config (config.py), preemption, the evaluator
task (evaluating checkpoints with tfdist.evaluate), and smoke steps.
"""

from tfdist.training.config import ConfigError, TrainConfig
from tfdist.training.evaluator import EvalRecord, evaluate_checkpoints
from tfdist.training.report import TrainResult
from tfdist.training.run import Trainer, train
from tfdist.training.smoke import SmokeResult, run_smoke_steps

__all__ = [
    "ConfigError",
    "EvalRecord",
    "SmokeResult",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "evaluate_checkpoints",
    "run_smoke_steps",
    "train",
]
