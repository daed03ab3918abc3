"""Where a pipeline keeps a model's weights and its optimizer's slots: in its stage
replicas, and nowhere else (see StageStore).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist import compat
from tfdist.collective.ring import owned_chunk
from tfdist.errors import FitError
from tfdist.parallel import host, optimizer_copies, stand_in
from tfdist.parallel.flat_slices import flat_slice, joined, slice_size
from tfdist.parallel.pipeline.stages import Stage
from tfdist.training import shards


@dataclasses.dataclass
class StageReplica:
    """One replica of one stage: its place, its weights and its optimizer (on its device).

    Under shard_optimizer, `slices[j]` is this replica's flat slice of its j-th weight (the
    pipeline's, of D: see slice_size), or None for a weight kept whole. The optimizer
    updates the slices (its slots are slices too); under zero3 the slice is all the replica
    keeps of the weight (`trainable[j]` is the slice), gathered for each step.

    A stage replica that is a tensor group (pipeline/tensor.py) is T of these, `member`
    0 to T-1, each on its own device: a member's copy of a weight the layout splits is its
    part (and so are its slots).
    """

    stage: Stage
    pipeline: int
    device: str
    trainable: list[keras.Variable]
    non_trainable: list[keras.Variable]
    optimizer: keras.optimizers.Optimizer | None  # built once the weights have moved in
    slices: list[keras.Variable | None] = dataclasses.field(default_factory=list)
    member: int = 0

    @property
    def updated(self) -> list[keras.Variable]:
        """What the optimizer updates, weight by weight: the slice, or the whole weight."""
        if not self.slices:
            return list(self.trainable)
        return [s if s is not None else w for s, w in zip(self.slices, self.trainable, strict=True)]


@dataclasses.dataclass(frozen=True)
class Cut:
    """How the copies of a weight that are pieces of it make it up: `parts` parts along
    `axis` (a tensor-parallel layout; 1: none), each cut into `slices` flat slices of its
    values (shard_optimizer over the pipelines; 1: none). A copy is piece (part, slice)."""

    parts: int = 1
    axis: int | None = None
    slices: int = 1

    def piece(self, value, key: tuple[int, int]) -> tf.Tensor:
        """Piece `key` of `value`, in a buffer of its own: TensorFlow's slice (or split) of
        a tensor's leading rows shares the tensor's buffer, and a variable assigned it may
        keep that buffer, so the piece kept would keep the whole alive."""
        part, k = key
        if self.parts > 1:
            value = tf.split(value, self.parts, axis=self.axis)[part]
        if self.slices > 1:
            value = flat_slice(value, self.slices, k)
        return tf.raw_ops.DeepCopy(x=tf.convert_to_tensor(value))

    def part_shape(self, shape) -> list[int]:
        """The shape of a part of a whole of `shape`."""
        part_shape = list(shape)
        if self.parts > 1:
            part_shape[self.axis] //= self.parts
        return part_shape

    def piece_size(self, shape) -> int:
        """The elements of each piece of a whole of `shape`: a part's padded flat slice,
        or a part."""
        part_shape = self.part_shape(shape)
        return slice_size(part_shape, self.slices) if self.slices > 1 else int(np.prod(part_shape))

    def joined(self, pieces: dict, shape) -> tf.Tensor:
        """The whole, of `shape`, from one copy of each piece ({(part, slice): value})."""
        part_shape = self.part_shape(shape)
        parts = []
        for j in range(self.parts):
            flat = [pieces[j, k] for k in range(self.slices)]
            parts.append(joined(flat, part_shape) if self.slices > 1 else flat[0])
        return parts[0] if self.parts == 1 else tf.concat(parts, self.axis)


def piece_of(pipeline: int, count: int) -> int:
    """Which of `count` flat slices pipeline `pipeline`'s replica of a stage holds: the chunk
    a ring reduce-scatter leaves complete at that rank (tfdist.collective.ring), so that
    between processes the stage's ring sums and gathers the slices where they are held."""
    return owned_chunk(pipeline, count)


class StageStore(shards.Shards):
    """Where a pipeline keeps a model's weights and its optimizer's slots, from the first
    fit on: in this process's stage replicas, and nowhere else.

    Each trainable weight's storage, and each of the user's optimizer's slots' (see
    compat.replace_storage), becomes a `StoredInStages`: reading it reads the stage replica that
    holds it (across worker processes, that replica's process sends it to every process,
    a collective all make together, as all save together); assigning it assigns every
    replica of this process that holds it. So `model.save`, `get_weights`, evaluation,
    callbacks and checkpoints see one Keras model, read one variable at a time, and a
    restore (`load_weights`, BackupAndRestore) lands in the stages. It lives as long as
    the model (its storages point here): a later fit on the same layout goes on with the
    same stage replicas, slots and all.
    """

    # runner: the PipelineRunner (pipeline/runner.py, which imports this module)
    def __init__(self, key: tuple, runner: Any, replicas: list[StageReplica]):
        self.key, self.strategy, self.processes = key, runner.strategy, runner.processes
        self.pipelines = runner.pipelines
        self.stages, self.tied, self.replicas = runner.stages, runner.tied, replicas
        self.shared, self.sliced = runner.shared, runner.sliced
        # A tensor-parallel layout's placement of each weight (None: no layout): members
        # hold parts of the weights it splits.
        self.placements = runner.placements
        self.tensor_stages = None  # pipeline_tensor.TensorStages, kept for later fits
        # Each process holds every pipeline's replicas of its stages (see PipelineRunner).
        self.whole_stages = runner.whole_stages
        # zero3: the weights' copies are slices too, as every sliced weight's slots are.
        self.weights_sliced = runner.shard == "zero3"
        # By pipeline, then stage, then member: pipeline 0's first holder of a weight is its
        # source.
        self._ordered = sorted(replicas, key=lambda r: (r.pipeline, r.stage.index, r.member))
        self.staged: list[tuple[str, StoredInStages]] = []  # by checkpoint key (shards.py)
        self._placeholders: dict[tf.DType, tf.Variable] = {}
        self._sent = tf.function(self._send_part, reduce_retracing=True)

    @staticmethod
    def of(model: keras.Model) -> StageStore | None:
        for variable in model.trainable_variables:
            storage = compat.storage_of(variable)
            if isinstance(storage, StoredInStages):
                return storage.store
        return None

    # --- which replica holds what ---------------------------------------------------------

    def holding(self, i: int) -> tuple[int, ...]:
        """The stages that hold trainable weight `i` (several for a tied weight)."""
        return self.tied.get(i) or tuple(s.index for s in self.stages if i in s.trainable)

    def source(self, i: int) -> bool:
        """Whether this process sends weight `i` (and its slots) where it is read: it holds
        pipeline 0's first stage holding it. In one process every stage is here."""
        if self.processes == 1:
            return True
        first = min(self.holding(i))
        return any(r.pipeline == 0 and r.stage.index == first for r in self.replicas)

    def copies(self, i: int, slot: str | None = None) -> list[keras.Variable]:
        """This process's replicas' copies of weight `i` (or of its slot named `slot`),
        the source's first."""
        return [copy for copy, _ in self._held(i, slot)]

    def _held(self, i: int, slot: str | None) -> list[tuple[keras.Variable, StageReplica]]:
        """(copy, the replica holding it), as `copies`."""
        out = []
        for r in self._ordered:
            if i not in r.stage.trainable:
                continue
            if slot is None:
                out.append((r.trainable[r.stage.trainable.index(i)], r))
            else:  # none where the stage's optimizer keeps no such slot
                out += [(v, r) for v in r.optimizer.variables if v.name == slot][:1]
        return out

    def _cut(self, i: int, *, slices: bool) -> Cut:
        """How pieces of weight `i` (or of a slot of it) make it up: its tensor-parallel
        parts, and (`slices`) their flat slices over the pipelines."""
        placement = None if self.placements is None else self.placements[i]
        split = placement is not None and placement.parts > 1
        return Cut(
            placement.parts if split else 1, placement.axis if split else None,
            self.pipelines if slices else 1,
        )  # fmt: skip

    def _key(self, i: int, r: StageReplica, cut: Cut) -> tuple[int, int]:
        """Which piece (part, slice) of weight `i` replica `r` holds under `cut`."""
        part = self.placements[i].index(r.member) if cut.parts > 1 else 0
        return part, piece_of(r.pipeline, self.pipelines) if cut.slices > 1 else 0

    def _updated_slices(self, i: int) -> tuple[list[tuple[keras.Variable, tuple]], Cut | None]:
        """zero1 and zero2: ([(slice, its piece)], how they cut the weight) of weight `i`
        that this process's replicas update beside the whole copies (or tensor-parallel
        parts) their passes read (loaded with them)."""
        if i not in self.sliced or self.weights_sliced:
            return [], None
        cut = self._cut(i, slices=True)
        out = []
        for r in self._ordered:
            if i in r.stage.trainable:
                out.append((r.slices[r.stage.trainable.index(i)], self._key(i, r, cut)))
        return out, cut

    def _pieces(self, i: int, slot: str | None) -> tuple[list[tuple[int, int]], Cut] | None:
        """(which piece each of `copies(i, slot)` holds, how the pieces make the whole),
        where they are pieces: a tensor-parallel layout's parts (by member), and their
        slices over the pipelines (piece_of the pipeline; see StageReplica), on every
        process alike (a process holding none gets []); None where each is whole."""
        sliced = i in self.sliced and (slot is not None or self.weights_sliced)
        cut = self._cut(i, slices=sliced)
        if cut == Cut():
            return None
        return [self._key(i, r, cut) for _, r in self._held(i, slot)], cut

    # --- moving in --------------------------------------------------------------------------

    def take_weights(self, model: keras.Model) -> None:
        """Each trainable weight's value moves into its stage replicas and its whole copy
        is dropped, one weight at a time."""
        dropped = host.Dropped()
        for i, weight in enumerate(model.trainable_variables):
            self._take(
                weight, i, self.copies(i), shards.weight_key(i), dropped=dropped,
                pieces=self._pieces(i, None), updated=self._updated_slices(i),
            )  # fmt: skip
        compat.forget_traced_functions(model)  # they read the whole copies
        dropped.free()  # now, not at the collector's whim

    def take_slots(self, model: keras.Model, fresh: set[int]) -> None:
        """The same for the user's optimizer's slots, matched to the stage optimizers' by
        name (a copy's slots are named after the weight, as the user's are). A slot whose
        storage is in `fresh` (ids) was made without a value: the stage's slot, built by the
        same optimizer, starts as it would."""
        user = model.optimizer
        paths = {v.path.replace("/", "_"): i for i, v in enumerate(model.trainable_variables)}
        skip = {id(user.iterations), id(getattr(user, "_learning_rate", None))}
        dropped = host.Dropped()
        for slot in user.variables:
            if id(slot) in skip:
                continue
            i = shards.weight_of_slot(slot.name, paths)
            copies = [] if i is None else self.copies(i, slot.name)
            if i is None or (self.copies(i) and not copies):
                raise FitError(
                    f"Cannot match the optimizer state {slot.name!r} of "
                    f"{type(user).__name__} with a weight's slot in the pipeline's stages "
                    "(its slots are not named after the weights): the stages could not "
                    f"keep it. Use a Keras optimizer. Received: {type(user).__name__}"
                )
            name = slot.name[len(model.trainable_variables[i].path) + 1 :]  # "momentum"
            self._take(
                slot, i, copies, shards.slot_key(i, name), fresh, dropped=dropped,
                pieces=self._pieces(i, slot.name),
            )  # fmt: skip
        dropped.free()

    def _take(
        self,
        variable: keras.Variable,
        i: int,
        copies: list,
        key: str,
        fresh: set[int] = frozenset(),
        *,
        dropped: host.Dropped,
        pieces: tuple[list[tuple[int, int]], Cut] | None = None,
        updated: tuple[list, Cut | None] = ((), None),
    ) -> None:
        old = compat.storage_of(variable)
        if not self.holding(i):
            return  # no stage reads the weight: it keeps its storage
        if id(old) not in fresh:  # an empty placeholder holds nothing to free
            dropped.add(old)
        staged = StoredInStages(
            self, old, variable.shape, copies, self.source(i), *(pieces or (None, None)),
            index=i, updated=updated[0], updated_cut=updated[1],
        )  # fmt: skip
        # A read of a weight held in parts (another layout's stages, host_scope's slices)
        # is a collective: every process makes it.
        if id(old) not in fresh and (copies or getattr(old, "read_by_collectives", False)):
            staged.assign(tf.convert_to_tensor(old))
        compat.replace_storage(variable, staged)
        self.staged.append((key, staged))

    # --- sharded checkpoints --------------------------------------------------------------

    def entries(self) -> list[shards.Entry]:
        """This process's part of a sharded checkpoint, each tensor saved flat as slices of
        its flattened values, as zero3 saves its slices: any layout reads any part of it.
        Each is made when its bundle is written, from this process's copies alone:
        - a weight or slot held whole, or in pieces a process holds all of (one process;
          whole stages), by its source, whole;
        - one held in pieces over the processes (a stage replica a process), by each
          process holding the first stage that holds it: the runs its pieces make
          (PieceRuns), where they leave no gap; where they would (not in a layout tfdist
          builds today), put together by a read every process makes, written whole."""
        out = []
        for key, staged in self.staged:
            n = staged.shape.num_elements()
            spec = shards.flat_slice(n, 0, n)
            spread = staged.pieces is not None and not self.whole_stages and self.processes > 1
            if spread and PieceRuns.every_slice_complete(staged.cut, staged.shape):
                first = self.replicas[0].stage.index == min(self.holding(staged.index))
                if staged.copies and first:
                    runs = PieceRuns(staged.cut, staged.shape, staged.pieces)
                    out += runs.writes(key, staged)
            elif spread:  # put together across processes, by all
                whole = staged.read()
                if staged.source and staged.copies:
                    flat = tf.reshape(whole, [-1])
                    out.append(shards.Entry(key, flat, spec, weight_shape=tuple(staged.shape)))
            elif staged.source and staged.copies:
                made = lambda staged=staged: tf.reshape(self._here(staged), [-1])  # noqa: E731
                out.append(shards.Entry(key, made, spec, staged.dtype, (n,), tuple(staged.shape)))
        return out

    def wanted(self) -> list[shards.Wanted]:
        """What this process's stages read back: each weight and slot they hold, whole,
        or where a process holds slices of it that other processes' replicas complete (a
        stage's pipelines across processes), the runs of its flattened values that hold
        those slices (PieceRuns)."""
        out = []
        for key, staged in self.staged:
            if not staged.copies:
                continue
            if staged.pieces is not None and staged.cut.slices > 1 and not self.whole_stages:
                out += PieceRuns(staged.cut, staged.shape, staged.pieces).reads(key, staged)
            else:
                out.append(
                    shards.Wanted(key, staged.dtype, staged.assign, shape=tuple(staged.shape))
                )
        return out

    # --- reading --------------------------------------------------------------------------

    def read(self, staged: StoredInStages) -> tf.Tensor:
        if self.processes == 1:
            return self._here(staged)
        context = tf.distribute.get_replica_context()
        part = self._part(staged)
        if context is not None and context.strategy is self.strategy:
            with tf.device(self.replicas[0].device):
                summed = context.all_reduce(tf.distribute.ReduceOp.SUM, self._once(part))
        else:
            with stand_in.read_together("a pipeline", self.strategy):
                summed = self._sent(part)
        if staged.pieces is None or self.whole_stages:
            return summed
        return staged.cut.joined(self._unflattened(staged, summed), staged.shape)

    def _here(self, staged: StoredInStages) -> tf.Tensor:
        """The weight from this process's copies: the first, or one of each piece put
        together (in order)."""
        if staged.pieces is None:
            return tf.identity(staged.copies[0].value)
        first = {}
        for copy, k in zip(staged.copies, staged.pieces, strict=True):
            first.setdefault(k, copy)
        with tf.device(self.replicas[0].device):
            pieces = {k: copy.value for k, copy in first.items()}
            return staged.cut.joined(pieces, staged.shape)

    def _once(self, part: tf.Tensor) -> tf.Tensor:
        """`part` on this process's first replica, zeros on its others: a sum over every
        replica then counts each process once."""
        context = tf.distribute.get_replica_context()
        local = len(self.strategy.extended.worker_devices)
        first = tf.equal(context.replica_id_in_sync_group % local, 0)
        return tf.where(first, part, tf.zeros_like(part))

    def _part(self, staged: StoredInStages) -> tf.Tensor:
        """What this process adds to a read across processes: the value at its source,
        zeros elsewhere (so the sum is the value, exactly). Pieces held a stage replica a
        process (slices over the pipelines, a tensor group's parts): each piece in its
        place, flat and padded, from the first stage holding the weight (a slice from every
        pipeline's replica of it, a part unsliced from the source's)."""
        with tf.device(self.replicas[0].device):
            if staged.pieces is not None and not self.whole_stages:
                cut = staged.cut
                size = cut.piece_size(staged.shape)
                r, held = self.replicas[0], {}
                first = r.stage.index == min(self.holding(staged.index))
                if staged.copies and first and (cut.slices > 1 or staged.source):
                    for copy, key in zip(staged.copies, staged.pieces, strict=True):
                        held.setdefault(key, copy)
                flat = [
                    tf.reshape(held[j, k].value, [-1]) if (j, k) in held
                    else tf.zeros([size], staged.dtype)
                    for j in range(cut.parts) for k in range(cut.slices)
                ]  # fmt: skip
                return tf.concat(flat, 0)
            if staged.source:
                return self._here(staged)
            return tf.zeros(staged.shape, staged.dtype)

    def _unflattened(self, staged: StoredInStages, flat: tf.Tensor) -> dict:
        """The pieces {(part, slice): value} of a read's sum (`_part`'s order)."""
        cut = staged.cut
        size, shape = cut.piece_size(staged.shape), cut.part_shape(staged.shape)
        pieces, at = {}, 0
        for j in range(cut.parts):
            for k in range(cut.slices):
                value = flat[at : at + size]
                pieces[j, k] = value if cut.slices > 1 else tf.reshape(value, shape)
                at += size
        return pieces

    def _send_part(self, part: tf.Tensor) -> tf.Tensor:
        def replica(part):
            with tf.device(self.replicas[0].device):
                part = self._once(tf.identity(part))
                return tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, part, options=stand_in.read_options()
                )

        sent = self.strategy.run(replica, args=(part,))
        return self.strategy.experimental_local_results(sent)[0]

    def placeholder(self, dtype) -> tf.Variable:
        """An empty variable: the resource handle of a weight no replica here holds."""
        dtype = tf.as_dtype(dtype)
        if dtype not in self._placeholders:
            device = self.replicas[0].device

            def make():
                with tf.device(device):
                    return tf.Variable(tf.zeros([0], dtype), trainable=False)

            self._placeholders[dtype] = optimizer_copies.outside_strategy(make)
        return self._placeholders[dtype]


class StoredInStages(stand_in.WholeStandIn):
    """A weight's (or a slot's) storage under a pipeline: see StageStore."""

    def __init__(
        self,
        store: StageStore,
        old,
        shape,
        copies: list[keras.Variable],
        source: bool,
        pieces: list[int] | None = None,
        cut: Cut | None = None,
        *,
        index: int,
        updated: list[tuple[keras.Variable, tuple[int, int]]] = (),
        updated_cut: Cut | None = None,
    ):
        dtype = old.dtype  # not `old` itself: the stand-in must not keep the whole copy
        super().__init__(old, lambda: copies[0] if copies else store.placeholder(dtype))
        self.shape = tf.TensorShape(shape)
        self.store, self.copies, self.source = store, copies, source
        # Under shard_optimizer: copy k is slice pieces[k] of store.pipelines (a slot's, or
        # under zero3 a weight's); under a tensor-parallel layout, part pieces[k] of the
        # layout's (`cut` says which); None: each copy is whole.
        self.pieces, self.cut = pieces, cut
        self.index = index  # the weight's position in model.trainable_variables
        # zero1, zero2: the slices (and their pieces, cut by `updated_cut`) the optimizer
        # updates beside the whole copies, given each value assigned too.
        self.updated, self.updated_cut = list(updated), updated_cut
        self.trainable = getattr(old, "trainable", True)

    def read(self) -> tf.Tensor:
        return self.store.read(self)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name, read_value
        value = tf.convert_to_tensor(value, self.dtype)
        if self.pieces is not None:
            for copy, k in zip(self.copies, self.pieces, strict=True):
                copy.assign(self.cut.piece(value, k))
        else:
            for copy in self.copies:
                copy.assign(value)
        for piece, k in self.updated:
            piece.assign(self.updated_cut.piece(value, k))


class PieceRuns:
    """Where pieces of a weight lie in its flattened values: each piece (part j, flat slice
    k of the part) as the positions of its elements in the whole, and the runs of the whole
    from a piece's first element to its last, merged where they meet. A column part's rows
    lie apart in the whole, so its run spans the other parts' columns between them; a
    process holding every part's slice k holds the same rows of every part, one run with
    no gap (`complete`).

    Args:
      cut: how the pieces make up the weight.
      shape: the weight's shape.
      pieces: the pieces (part, slice) wanted, in any order, repeats ignored.
    """

    def __init__(self, cut: Cut, shape, pieces):
        self.cut, self.shape = cut, [int(d) for d in shape]
        self.size, self.n = cut.piece_size(self.shape), int(np.prod(self.shape))
        part_shape = cut.part_shape(self.shape)
        part_n = int(np.prod(part_shape))
        self.positions: dict[tuple[int, int], np.ndarray] = {}
        for j, k in dict.fromkeys(pieces):
            inside = np.arange(k * self.size, min((k + 1) * self.size, part_n), dtype=np.int64)
            where = list(np.unravel_index(inside, part_shape))
            if cut.parts > 1:
                where[cut.axis] = where[cut.axis] + j * part_shape[cut.axis]
            self.positions[j, k] = (
                np.ravel_multi_index(where, self.shape) if inside.size else inside
            )
        self.runs: list[list] = []  # [lo, hi, pieces]
        for piece, at in sorted(self.positions.items(), key=lambda item: item[1][:1].tolist()):
            if not at.size:
                continue
            lo, hi = int(at[0]), int(at[-1]) + 1
            if self.runs and lo <= self.runs[-1][1]:
                self.runs[-1][1] = max(self.runs[-1][1], hi)
                self.runs[-1][2].append(piece)
            else:
                self.runs.append([lo, hi, [piece]])
        # Pieces past the weight's end (a slice of padding only).
        self.empty = [piece for piece, at in self.positions.items() if not at.size]

    @property
    def complete(self) -> bool:
        """Whether each run holds nothing but these pieces' elements."""
        return all(
            hi - lo == sum(self.positions[p].size for p in pieces) for lo, hi, pieces in self.runs
        )

    @classmethod
    def every_slice_complete(cls, cut: Cut, shape) -> bool:
        """Whether, for every slice k, all parts' slice k make runs with no gap: then a
        process holding a stage replica whole (every part) writes its runs alone."""
        return all(
            cls(cut, shape, [(j, k) for j in range(cut.parts)]).complete for k in range(cut.slices)
        )

    def reads(self, key: str, staged: StoredInStages) -> list[shards.Wanted]:
        """A read of each run, handed to the copies of `staged` whose pieces it holds."""

        def handed(lo: int, pieces: list) -> Callable[[tf.Tensor], None]:
            def assign(value) -> None:
                flat = tf.reshape(tf.convert_to_tensor(value, staged.dtype), [-1])
                for copy, piece in zip(staged.copies, staged.pieces, strict=True):
                    if piece in pieces:
                        mine = tf.gather(flat, self.positions[piece] - lo)
                        copy.assign(shards.padded(mine, self.size))
                    elif piece in self.empty and lo == self.runs[0][0]:
                        copy.assign(tf.zeros([self.size], staged.dtype))

            return assign

        return [
            shards.Wanted(key, staged.dtype, handed(lo, pieces),
                          shards.flat_slice(self.n, lo, hi), weight_shape=tuple(self.shape))
            for lo, hi, pieces in self.runs
        ]  # fmt: skip

    def writes(self, key: str, staged: StoredInStages) -> list[shards.Entry]:
        """Each run (complete) as a slice of the flattened weight, put together from the
        copies of `staged` when its bundle is written."""
        first = {}
        for copy, piece in zip(staged.copies, staged.pieces, strict=True):
            first.setdefault(piece, copy)

        def made(lo: int, hi: int, pieces: list) -> Callable[[], tf.Tensor]:
            def value() -> tf.Tensor:
                where = np.concatenate([self.positions[p] - lo for p in pieces])[:, None]
                held = [first[p].value[: self.positions[p].size] for p in pieces]
                return tf.scatter_nd(where, tf.concat(held, 0), [hi - lo])

            return value

        return [
            shards.Entry(key, made(lo, hi, pieces), shards.flat_slice(self.n, lo, hi),
                         staged.dtype, (hi - lo,), tuple(self.shape))
            for lo, hi, pieces in self.runs
        ]  # fmt: skip


@contextlib.contextmanager
def empty_variables():
    """While entered, each variable made is an empty placeholder (its initial value is
    made and dropped, one at a time); yields the list of those made, to be given their
    storage (compat.replace_storage). Keras's optimizers make every slot in `build`, at
    once: this keeps the user's optimizer from holding every slot whole while it is built,
    when the stages hold them."""
    made: list[tf.Variable] = []

    def creator(next_creator, **kwargs):
        value = kwargs["initial_value"]
        value = value() if callable(value) else value
        kwargs["initial_value"] = tf.zeros([0], tf.as_dtype(value.dtype).base_dtype)
        kwargs.pop("shape", None)
        made.append(next_creator(**kwargs))
        return made[-1]

    with tf.variable_creator_scope(creator):
        yield made
