"""The training engine behind `tfdist.fit`, and the seam new parallel modes plug into.

The layers, top down (imports run one way only; tests/test_imports.py checks it):

  tfdist/app/        the training binary's application (Trainer, TrainConfig, evaluator)
  tfdist/api/        the facade: tfdist.fit / evaluate / predict
  tfdist/parallel/   the modes, one file each, and their registry
  tfdist/training/   this engine: it imports none of the layers above

How a `tfdist.fit(model, data, ...)` call runs (api/fit.py): it checks the call as Keras
would (keywords, a compiled model made under the strategy's scope, labels), turns the data
into a FitData (fit_data.py), picks an engine (the strategy's kind decides, or a mode that
is a RunnerFactory: the pipeline), builds the chain of StepHooks its keywords ask for
(tfdist.parallel.registry; chain.py checks the chain and keeps the hooks that keep state
across fits), and hands both to a Controller.

  engine.py       the contract the controller drives, ten members (as Orbit's trainer):
                  build, begin, reset, train(n steps), logs, settle, evaluate, state (what
                  a checkpoint holds of it), report (step times, figures) and its `job`.
  job.py          the facts of the job an engine trains in: the chief, the placement, the
                  processes in lockstep and their tally, the data's way to the replicas, and
                  a lost peer or parameter server as one line naming the task
                  (`explained()`). Job (one process), LockstepJob, CoordinatedJob.
  hooks.py        StepHook and AsyncStep: where a step can be changed.
  runners/        one engine per kind of strategy, in a table keyed by
                  tfdist.strategy_kind (runners/__init__.py): SyncRunner (one_device,
                  mirrored, multi_worker_mirrored, tpu), CentralStorageRunner,
                  ParameterServerRunner (given a SplitReplica, Downpour's split replica),
                  and what 'auto' means for a mode under each (`mode_defaults`).
  loop.py         the traced loop of a call's steps, written once; an engine supplies its step.
  chain.py        the rules of a chain of hooks (one update; its applier last).
  controller.py   Keras's fit loop (epochs, callbacks, validation, resuming mid-epoch from a
                  BackupAndRestore or tfdist checkpoint, the stop vote, SIGTERM -> back up at
                  this step and raise Preempted, the step-time report). It talks to an
                  Engine and its Job only and never asks which strategy it runs under.
  steps.py        the model's own train_step / test_step and their logs (Keras's rule), and
                  `updates_through`, which routes a step's optimizer update through the
                  StepHooks.
  step_times.py   where a step's time goes (input, compute, exchange), measured in the graph.
  checkpoints.py, report.py, callbacks.py: the public callbacks StepCheckpoint, RunRecord,
                  LearningRateWarmup (and WarmupSchedule).

The step seam. Every step computes its gradients and then calls `optimizer.apply`; while a
step is traced, that call runs a chain of StepHooks, each of which may change the gradients
and hand them on (`apply_next`), hold them (accumulation), or apply them its own way
(sharded optimizer state, local SGD). The chain runs in replica context, once per replica
step, whether the step is Keras's `train_step`, the model's own override, or the
parameter-server runner's stateless step. A new parallel mode is one new file in
tfdist/parallel/ and one entry in tfdist/parallel/registry.py:

    class ShardedUpdate(tfdist.StepHook):            # zero/sharded.py: ZeRO stages 1 and 2
        synchronous_only = True                      # central_storage / ps refuse it
        applies_update = ends_chain = True           # the step's one update, last
        keeps_optimizer_state = True                 # BackupAndRestore cannot save it

        def build(self, model, job):                 # slices, and an optimizer per slice:
            layout = job.placement                   # this process's devices, its rank,
            ...                                      # the processes (not the strategy)

        def apply(self, grads_and_vars, apply_next):
            ...reduce-scatter, update this replica's slice, all-gather; no apply_next...

        def checkpoint_state(self):                  # the slices' slots, saved whole
            return {"sharded_optimizer_state": ...}

    Mode(keyword="shard_optimizer", value=Choice(("zero1", "zero2")), place=Place.UPDATE,
         builder="tfdist.parallel.zero.sharded:ShardedUpdate", resume_must_match=True, ...)

From the entry come fit's keyword and its docstring line, the binary's flag and help,
TrainConfig's field, the hook's place in the chain and its checkpoint rule:

    tfdist.fit(model, data, accumulate_steps=4, shard_optimizer="zero2")
    # = tfdist.fit(model, data, step_hooks=[Accumulate(4), ShardedUpdate(2)])

Local SGD and gossip (local_sgd.py, gossip.py) apply each replica's gradients with its own
optimizer copy and mix the weights after; their `settle()` (each epoch end, before a save)
makes the replicas one model. The parameter-server engine also calls a hook's
`begin_step(AsyncStep)` before a step reads the weights and `before_update(AsyncStep)`
before it counts and applies its update, with the step's ticket (its place in the
coordinator's order) and, for `apply`, its staleness: delay compensation remembers what was
read there, a staleness bound waits there (asynchronous.py; `asynchronous_only = True`).

A mode that changes the whole step rather than its update (pipeline stages with
micro-batches) is a RunnerFactory: its value makes an Engine of its own (built from the
pieces above, not on another engine's class), and the Controller runs it unchanged.

Callbacks reach the engine too: a callback with a `set_runner(engine)` method is given the
engine before training, and may ask its job who the chief is (`engine.job.is_chief`), the
engine to settle the variables before a save (`settle()`: every scheduled step applied, the
replicas one model), what else a checkpoint must hold (`state()`) and what it did
(`report()`). tfdist's own StepCheckpoint (checkpoints.py) and RunRecord (report.py) are
built so.

Names are imported on first use: importing one module of the engine runs no other.
"""

from tfdist.lazy import lazy_exports

_EXPORTS = {
    "AsyncStep": "tfdist.training.hooks",
    "Engine": "tfdist.training.engine",
    "Job": "tfdist.training.job",
    "ReplicaPlacement": "tfdist.strategies.replicas",
    "RunnerFactory": "tfdist.training.engine",
    "StepHook": "tfdist.training.hooks",
    "Controller": "tfdist.training.controller",
    "FitData": "tfdist.training.fit_data",
    "make_fit_data": "tfdist.training.fit_data",
    "runner_for": "tfdist.training.runners",
    "StepCheckpoint": "tfdist.training.checkpoints",
    "RunRecord": "tfdist.training.report",
    "TrainResult": "tfdist.training.report",
    "LearningRateWarmup": "tfdist.training.callbacks",
    "WarmupSchedule": "tfdist.training.callbacks",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
