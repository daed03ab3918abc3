"""TF_CONFIG -> ClusterInfo: parse, normalise and validate the cluster a launcher describes.

Every multi-worker launcher (Kubeflow's TFJob, Vertex AI, SageMaker, tfdist's own
``tfdist-launch``) tells each process its place in the job through the TF_CONFIG environment
variable. TensorFlow reads it lazily and fails late — often with a hang or a deep traceback.
tfdist reads it once, at start-up, and turns every mistake it can see into one
``TFConfigError`` that says what was wrong and how to fix it. Engines that set no TF_CONFIG
(a JobSet written by ``tfdist-k8s jobset``) describe the job through other variables;
`cluster_from_environment` reads either, and is what tfdist's entry points call.

Example:

    >>> info = parse_tf_config({
    ...     "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
    ...     "task": {"type": "worker", "index": 1},
    ... })
    >>> info.num_workers, info.is_chief, info.address
    (2, False, '10.0.0.2:2222')
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
from collections.abc import Mapping, MutableMapping
from typing import Any

from tfdist.errors import TfdistError
from tfdist.k8s.jobset_env import jobset_tf_config
from tfdist.layout import Layout, single_task_rule, too_many
from tfdist.slurm import slurm_tf_config

TF_CONFIG_ENV = "TF_CONFIG"

CHIEF, WORKER, PS, EVALUATOR = "chief", "worker", "ps", "evaluator"
TASK_TYPES = (CHIEF, WORKER, PS, EVALUATOR)
# Kubeflow's older TFJob and SageMaker call the chief "master"; TensorFlow 2 calls it "chief".
_ALIASES = {"master": CHIEF}
# Keys real launchers write (Kubeflow: environment; Vertex AI: job, trial).
_KNOWN_TOP_LEVEL_KEYS = {
    "cluster",
    "sparseCluster",
    "task",
    "environment",
    "rpc_layer",
    "job",
    "trial",
}


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Any = _FromEnv()
"""Default of every `cluster` argument: the environment's (`cluster_from_environment`)."""


class TFConfigError(TfdistError, ValueError):
    """TF_CONFIG does not describe a valid cluster; the message says what is wrong and the fix."""


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """This process's place in a multi-worker job, as TF_CONFIG describes it.

    Build it with `parse_tf_config`; the constructor assumes validated, normalised input.

    Attributes:
      task_type: 'chief', 'worker', 'ps' or 'evaluator' ('master' is normalised to 'chief').
      task_index: this task's index within its type.
      cluster: task type -> addresses ("host:port"), in index order. For a Kubeflow
        ``sparseCluster`` (dynamic workers) a type may list only some indices; then
        `sparse` is True and `sparse_indices` says which index each address belongs to.
      rpc_layer: the protocol between tasks, normally 'grpc'.
      environment: the launcher's "environment" entry (Kubeflow writes 'cloud'), if any.
      source: where the configuration came from, quoted in later error messages.
    """

    task_type: str
    task_index: int
    cluster: Mapping[str, tuple[str, ...]]
    rpc_layer: str = "grpc"
    environment: str | None = None
    sparse_indices: Mapping[str, tuple[int, ...]] | None = None
    source: str = "the TF_CONFIG environment variable"

    @property
    def sparse(self) -> bool:
        return self.sparse_indices is not None

    @property
    def num_workers(self) -> int:
        """Tasks that compute gradients in synchronous training: workers plus the chief."""
        return len(self.cluster.get(WORKER, ())) + len(self.cluster.get(CHIEF, ()))

    @property
    def num_ps(self) -> int:
        return len(self.cluster.get(PS, ()))

    @property
    def has_chief(self) -> bool:
        return bool(self.cluster.get(CHIEF))

    @property
    def has_evaluator(self) -> bool:
        return bool(self.cluster.get(EVALUATOR)) or self.task_type == EVALUATOR

    @property
    def is_chief(self) -> bool:
        """TensorFlow's rule: the chief task if there is one, else worker 0; never the evaluator."""
        if self.has_chief:
            return self.task_type == CHIEF
        return self.task_type == WORKER and self.task_index == 0

    @property
    def is_evaluator(self) -> bool:
        return self.task_type == EVALUATOR

    @property
    def address(self) -> str | None:
        """This task's own "host:port" (None for an evaluator that is not listed in the cluster)."""
        return dict(self.indexed_addresses(self.task_type)).get(self.task_index)

    def indexed_addresses(self, task_type: str) -> list[tuple[int, str]]:
        """(task index, "host:port") of every listed task of `task_type`, sparse clusters too."""
        addresses = self.cluster.get(task_type, ())
        indices = (self.sparse_indices or {}).get(task_type, range(len(addresses)))
        return list(zip(indices, addresses, strict=True))

    @property
    def cluster_strategy(self) -> str | None:
        """The multi-worker strategy the cluster's shape calls for, if any (`Layout.strategy`)."""
        return Layout.of_cluster(self.cluster).strategy

    @property
    def task_name(self) -> str:
        return f"{self.task_type}:{self.task_index}"

    def training_cluster(self) -> dict[str, Any]:
        """The cluster spec without the evaluator, in the form tf.train.ClusterSpec accepts.

        The evaluator never joins the training collective, so strategies must not see it.
        """
        spec: dict[str, Any] = {}
        for task_type in self.cluster:
            if task_type == EVALUATOR:
                continue
            indexed = self.indexed_addresses(task_type)
            if [index for index, _ in indexed] == list(range(len(indexed))):
                spec[task_type] = [address for _, address in indexed]
            else:  # some indices missing: TensorFlow's sparse form, index -> address
                spec[task_type] = dict(indexed)
        return spec

    def cluster_resolver(self):
        """A tf.distribute cluster resolver for this task, built from the normalised cluster.

        Strategies get this instead of reading TF_CONFIG themselves, so a launcher's
        'master' key or extra fields never reach TensorFlow.
        """
        import tensorflow as tf  # deferred: parsing TF_CONFIG must not cost a TensorFlow import

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.training_cluster()),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer=self.rpc_layer,
        )

    def task_counts(self) -> str:
        """How many tasks of each type, e.g. '1 chief, 2 workers, 1 ps'."""
        return ", ".join(
            f"{len(addresses)} {t}{'s' if t != PS and len(addresses) != 1 else ''}"
            for t, addresses in self.cluster.items()
        )

    def describe(self) -> str:
        """A one-line role summary, e.g. 'worker:1 at host:2222 in a cluster of 2 workers'."""
        role = "chief" if self.is_chief else "not chief"
        where = f" at {self.address}" if self.address else ""
        return f"{self.task_name}{where} in a cluster of {self.task_counts()} ({role})"


def parse_tf_config(
    raw: str | Mapping[str, Any] | None = None, *, source: str | None = None
) -> ClusterInfo | None:
    """Parses and validates a TF_CONFIG.

    Args:
      raw: TF_CONFIG as a JSON string or an already-decoded mapping. None reads the
        TF_CONFIG environment variable.
      source: where `raw` came from, for error messages (e.g. "the --tf_config flag").

    Returns:
      A ClusterInfo, or None when there is no cluster: TF_CONFIG unset or empty, ``{}``,
      or no "cluster" entry — the job then runs on this host alone.

    Raises:
      TFConfigError: TF_CONFIG is malformed or describes an impossible cluster.
    """
    if raw is None:
        raw = os.environ.get(TF_CONFIG_ENV)
        source = source or f"the {TF_CONFIG_ENV} environment variable"
    return _Parser(source or f"the {TF_CONFIG_ENV} value passed to parse_tf_config()").parse(raw)


def cluster_from_environment(environ: MutableMapping[str, str] | None = None) -> ClusterInfo | None:
    """The cluster this process's environment describes, whichever engine started it.

    Every tfdist entry point that reads "the environment's cluster" comes here
    (`build_strategy`, `serve_if_needed`, the experiments binaries), so a pod of a JobSet
    written by ``tfdist-k8s jobset`` trains the same as one that was handed a TF_CONFIG.

    1. TF_CONFIG set (tfdist-launch, Kubeflow's TFJob operator, Vertex AI, Ray Train, ...):
       `parse_tf_config()` of it.
    2. Otherwise, the TFDIST_JOBSET_* variables of a JobSet pod (`tfdist.k8s.jobset_env`):
       the TF_CONFIG they stand for is derived, parsed, and exported as TF_CONFIG into
       `environ`, so TensorFlow (``TFConfigClusterResolver``), Keras and the user's own
       code see the same cluster, and a later call reads it back in step 1.
    3. Otherwise, the SLURM_* variables of a task `srun` started in a step of several tasks
       (`tfdist.slurm`): derived and exported the same way.
    4. Otherwise None: the job runs on this host alone.

    Example:

        cluster = tfdist.cluster_from_environment()
        if cluster is not None:
            print(cluster.describe())

    Args:
      environ: the environment to read and, in case 2, to write; os.environ by default.

    Returns:
      A ClusterInfo, or None when the environment describes no cluster.

    Raises:
      TFConfigError: TF_CONFIG is malformed or describes an impossible cluster.
      tfdist.k8s.JobSetEnvError: some TFDIST_JOBSET_* variables are set but not all the
        derivation needs, or one holds a value no tfdist-k8s manifest gives it.
      tfdist.slurm.SlurmEnvError: srun's variables are inconsistent.
    """
    environ = os.environ if environ is None else environ
    source = f"the {TF_CONFIG_ENV} environment variable"
    if (environ.get(TF_CONFIG_ENV) or "").strip():
        return parse_tf_config(environ[TF_CONFIG_ENV], source=source)
    if TF_CONFIG_ENV in environ:
        # Set but blank means no cluster, to tfdist; TensorFlow's own resolvers would fail to
        # parse it (a JSONDecodeError from inside MirroredStrategy), so it goes.
        del environ[TF_CONFIG_ENV]
    derived, engine = jobset_tf_config(environ), "JobSet"
    if derived is None:
        derived, engine = slurm_tf_config(environ), "Slurm (srun)"
    if derived is None:
        return None
    text = json.dumps(derived)
    info = parse_tf_config(text, source=f"{source} derived from the {engine} environment")
    environ[TF_CONFIG_ENV] = text
    return info


class _Parser:
    """Validation of one TF_CONFIG; holds the source so every message can name it."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, problem: str, fix: str, received: Any = dataclasses.MISSING) -> TFConfigError:
        message = f"Invalid TF_CONFIG (from {self.source}): {problem}. {fix}"
        if received is not dataclasses.MISSING:
            message += f" Received: {_short(received)}"
        return TFConfigError(message)

    def parse(self, raw: str | Mapping[str, Any] | None) -> ClusterInfo | None:
        config = self.decode(raw)
        if config is None:
            return None
        for key in sorted(set(config) - _KNOWN_TOP_LEVEL_KEYS):
            # Other keys are the launcher's business, but a misspelt "cluster" or "task" would
            # silently turn a multi-worker job into N independent single-host jobs.
            hint = _closest(key, ["cluster", "task", "sparseCluster"])
            if hint:
                raise self.fail(f"unknown top-level key {key!r}", f"Fix the spelling{hint}.")
        if "cluster" in config and "sparseCluster" in config:
            raise self.fail(
                "both 'cluster' and 'sparseCluster' are set",
                "Give exactly one of them; 'sparseCluster' is only for Kubeflow dynamic workers.",
            )
        sparse = "sparseCluster" in config
        raw_cluster = config.get("sparseCluster" if sparse else "cluster")
        if raw_cluster is None or raw_cluster == {}:
            return None  # a task section alone describes no cluster: run locally
        cluster, sparse_indices = self.cluster(raw_cluster, sparse=sparse)
        task_type, task_index = self.task(config.get("task"), cluster, sparse_indices)
        rpc_layer = config.get("rpc_layer") or "grpc"
        if not isinstance(rpc_layer, str):
            raise self.fail("'rpc_layer' is not a string", 'Use e.g. "grpc".', received=rpc_layer)
        environment = config.get("environment")
        return ClusterInfo(
            task_type=task_type,
            task_index=task_index,
            cluster=types.MappingProxyType(cluster),
            rpc_layer=rpc_layer,
            environment=None if environment is None else str(environment),
            sparse_indices=None
            if sparse_indices is None
            else types.MappingProxyType(sparse_indices),
            source=self.source,
        )

    def decode(self, raw: str | Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise self.fail(
                    f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}, char {e.pos})",
                    "TF_CONFIG must be a JSON object such as "
                    '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
                    '"task": {"type": "worker", "index": 0}}; '
                    "check the quoting where your launcher sets it.",
                    received=raw,
                ) from None
        if not isinstance(raw, Mapping):
            raise self.fail(
                f"the JSON is a {type(raw).__name__}, not an object",
                'Expected an object with "cluster" and "task" entries.',
                received=raw,
            )
        return raw or None

    def cluster(
        self, raw: Any, *, sparse: bool
    ) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[int, ...]] | None]:
        key = "sparseCluster" if sparse else "cluster"
        if not isinstance(raw, Mapping):
            raise self.fail(
                f"'{key}' is not a mapping of task type to a list of addresses",
                'Expected e.g. {"worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]}.',
                received=raw,
            )
        cluster: dict[str, tuple[str, ...]] = {}
        sparse_indices: dict[str, tuple[int, ...]] = {}
        seen: dict[str, str] = {}  # address -> "type:index", to catch two tasks on one port
        for raw_type, raw_addresses in raw.items():
            task_type = self.task_type(raw_type, where=f"'{key}'")
            if task_type in cluster:  # "master" and "chief" together
                raise self.fail(
                    "both 'master' and 'chief' are listed",
                    "'master' is the legacy name of 'chief'; a cluster has at most one chief. "
                    "Keep one of them.",
                    received=dict(raw),
                )
            indices, addresses = self.addresses(task_type, raw_addresses, key=key, sparse=sparse)
            for index, address in zip(indices, addresses, strict=True):
                task = f"{task_type}:{index}"
                if address in seen:
                    raise self.fail(
                        f"{seen[address]} and {task} both use the address {address}",
                        "Every task needs its own host:port; give one of them another port.",
                    )
                seen[address] = task
            if not addresses:
                continue  # an empty list is how some launchers say "none of this type"
            cluster[task_type] = addresses
            sparse_indices[task_type] = indices
        for task_type in too_many(Layout.of_cluster(cluster)):
            raise self.fail(
                f"{len(cluster[task_type])} {task_type} tasks are listed",
                single_task_rule(task_type),
                received=list(cluster[task_type]),
            )
        if not cluster:
            raise self.fail(
                f"'{key}' lists no tasks",
                "List at least one task, or unset TF_CONFIG to train on this host alone.",
                received=dict(raw),
            )
        # Keep the canonical order so summaries and cluster specs read the same everywhere.
        order = {t: i for i, t in enumerate(TASK_TYPES)}
        cluster = dict(sorted(cluster.items(), key=lambda kv: order[kv[0]]))
        return cluster, ({t: sparse_indices[t] for t in cluster} if sparse else None)

    def task_type(self, raw: Any, *, where: str) -> str:
        name = raw.strip().lower() if isinstance(raw, str) else raw
        name = _ALIASES.get(name, name)
        if name in TASK_TYPES:
            return name
        hint = _closest(str(raw), list(TASK_TYPES) + list(_ALIASES))
        raise self.fail(
            f"unknown task type {raw!r} in {where}",
            f"Valid task types are {', '.join(TASK_TYPES)} ('master' is read as 'chief'){hint}.",
        )

    def addresses(
        self, task_type: str, raw: Any, *, key: str, sparse: bool
    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if isinstance(raw, str):
            raise self.fail(
                f"'{key}'[{task_type!r}] is a single string, not a list",
                f'Wrap it in a list: "{task_type}": [{json.dumps(raw)}].',
            )
        if sparse and isinstance(raw, Mapping):
            items = []
            for raw_index, address in raw.items():
                index = self.index(raw_index, what=f"index {raw_index!r} of sparse {task_type!r}")
                items.append((index, address))
            items.sort()
        elif isinstance(raw, list | tuple):
            items = list(enumerate(raw))
        else:
            raise self.fail(
                f"'{key}'[{task_type!r}] is not a list of addresses",
                f'Expected e.g. "{task_type}": ["host1:2222", "host2:2222"].',
                received=raw,
            )
        indices = tuple(i for i, _ in items)
        addresses = tuple(self.address(a, task=f"{task_type}:{i}") for i, a in items)
        return indices, addresses

    def address(self, raw: Any, *, task: str) -> str:
        if not isinstance(raw, str) or not raw.strip():
            raise self.fail(
                f"the address of {task} is not a 'host:port' string",
                'Write each address as "host:port", e.g. "10.0.0.1:2222".',
                received=raw,
            )
        text = raw.strip()
        if text.startswith("["):  # bracketed IPv6, e.g. [::1]:2222
            host, sep, port_text = text[1:].partition("]:")
            host = f"[{host}]" if host else ""
        elif text.count(":") > 1:
            raise self.fail(
                f"the address {text!r} of {task} looks like an IPv6 address without brackets",
                'Put IPv6 hosts in brackets, e.g. "[::1]:2222".',
            )
        else:
            host, sep, port_text = text.rpartition(":")
        if not sep or not host or "/" in host:
            raise self.fail(
                f"the address {text!r} of {task} has no host or no port",
                'Write it as "host:port", e.g. "worker-0.my-job.svc:2222", with no scheme or path.',
            )
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise self.fail(
                f"the port of {task} in {text!r} is not a number from 1 to 65535",
                "Give a TCP port such as 2222.",
            )
        return f"{host.lower()}:{int(port_text)}"

    def index(self, raw: Any, *, what: str) -> int:
        # JSON object keys are strings, so sparse indices legitimately arrive as "1".
        if isinstance(raw, str) and raw.strip().isdigit():
            return int(raw)
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise self.fail(
                f"{what} is not an integer",
                "Task indices are whole numbers counted from 0.",
                received=raw,
            )
        if raw < 0:
            raise self.fail(f"{what} is negative", "Task indices count from 0.", received=raw)
        return raw

    def task(
        self,
        raw: Any,
        cluster: dict[str, tuple[str, ...]],
        sparse_indices: dict[str, tuple[int, ...]] | None,
    ) -> tuple[str, int]:
        total = sum(len(a) for a in cluster.values())
        if raw is None or raw == {}:
            if total == 1:  # one task and no doubt which it is: this process
                return next(iter(cluster)), (sparse_indices or {}).get(next(iter(cluster)), (0,))[0]
            raise self.fail(
                f"the cluster lists {total} tasks but there is no 'task' section",
                'Each process must say which task it is, e.g. "task": {"type": "worker", '
                '"index": 0}; launchers such as tfdist-launch or a TFJob set it per process.',
            )
        if not isinstance(raw, Mapping):
            raise self.fail(
                "'task' is not an object",
                'Expected e.g. "task": {"type": "worker", "index": 0}.',
                received=raw,
            )
        if "type" not in raw:
            raise self.fail(
                "'task' has no 'type'",
                f"Set 'type' to one of {', '.join(TASK_TYPES)}.",
                received=dict(raw),
            )
        task_type = self.task_type(raw["type"], where="'task'")
        if "index" not in raw:
            raise self.fail(
                "'task' has no 'index'",
                'Set it, e.g. "task": {"type": "worker", "index": 0}.',
                received=dict(raw),
            )
        raw_index = raw["index"]
        if isinstance(raw_index, str):  # only mappings' keys may be strings
            raise self.fail(
                "'task' 'index' is a string, not an integer",
                f'Write it without quotes: "index": {raw_index.strip() or 0}.',
                received=json.dumps(raw_index),
            )
        task_index = self.index(raw_index, what="'task' 'index'")
        if task_type not in cluster:
            if task_type == EVALUATOR and task_index == 0:
                return (
                    task_type,
                    task_index,
                )  # TensorFlow lets the evaluator stay outside the cluster
            raise self.fail(
                f"this task is a {task_type!r} but the cluster has no {task_type!r} tasks",
                f"Add its address to the cluster's {task_type!r} list, or correct 'task' 'type' "
                f"(the cluster has {', '.join(cluster)}).",
            )
        if sparse_indices is not None:
            if task_index not in sparse_indices[task_type]:
                raise self.fail(
                    f"task index {task_index} has no address in sparse {task_type!r}",
                    f"List this task's own address under index {task_index}.",
                )
        elif task_index >= len(cluster[task_type]):
            count = len(cluster[task_type])
            raise self.fail(
                f"task index {task_index} is out of range for {count} {task_type!r} task(s)",
                f"Valid indices are 0 to {count - 1}.",
                received=task_index,
            )
        return task_type, task_index


def _closest(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word.lower(), choices, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
