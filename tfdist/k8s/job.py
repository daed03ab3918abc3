"""What every Kubernetes manifest tfdist writes starts from: the job, its pods, and their checks.

A `TrainingJob` says what to run (an image and a command), how many tasks of each type
(a `tfdist.layout.Layout`), and what each pod asks for. The writers (`tfjob.py`, `jobset.py`)
turn it into their engine's manifest and add only their engine's own rules. The layout is
checked by `tfdist.layout.validate_layout`, the one place those rules live; messages spell a
fix as tfdist-k8s options (`k8s_flags`).

Every pod is locked down the same way, whatever the engine (`TrainingJob.pod_spec`): it runs
as a non-root user (`run_as_user`, 1000 by default) with no capabilities, no privilege
escalation and the runtime's default seccomp profile, which is what the Kubernetes "restricted"
Pod Security Standard asks for. Its root filesystem is read-only: TensorFlow and Python write
only to the temporary directory and HOME (autograph's generated code, ~/.keras, ~/.cache), so
an emptyDir is mounted at /tmp and HOME points there. What the program keeps goes to
``--model_dir``, which must be remote storage (``gs://...``) or a PersistentVolumeClaim mounted
at that path (`model_dir_claim`): a pod's own files are lost when the pod goes.
"""

from __future__ import annotations

import copy
import dataclasses
import posixpath
import re
import shlex
from collections.abc import Sequence
from typing import Any

from tfdist.errors import TfdistError
from tfdist.layout import Layout, flag_value, validate_layout

# The container every pod runs; the TFJob operator finds the training container by this name.
CONTAINER_NAME = "tensorflow"
DEFAULT_PORT = 2222
EXAMPLE_COMMAND = "python my_train.py"
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MAX_LABEL = 63
_DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
MAX_SUBDOMAIN = 253
# Many images run as root by default; the pods run as this user unless told otherwise.
DEFAULT_RUN_AS_USER = 1000
# The one writable place besides --model_dir: TensorFlow's and Python's scratch, and HOME.
SCRATCH_DIR = "/tmp"
SCRATCH_VOLUME = "tmp"
MODEL_DIR_VOLUME = "model-dir"
# "gs://", "s3://", "hdfs://", ...: storage outside the pod. file:// is the pod's own disk.
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_CPU = re.compile(r"(\d+(\.\d+)?|\.\d+)m?")
_MEMORY = re.compile(r"(\d+(\.\d+)?|\.\d+)([KMGTPE]i?|k)?")


class ManifestError(TfdistError, ValueError):
    """A job that Kubernetes, an operator or tfdist would refuse; the message gives the fix."""


def is_dns_1035_label(value: Any) -> bool:
    """Whether `value` may name a Service: a DNS-1035 label of at most 63 characters."""
    return (
        isinstance(value, str)
        and len(value) <= MAX_LABEL
        and _DNS_1035_LABEL.fullmatch(value) is not None
    )


def k8s_flags(layout: Layout) -> str:
    """`layout` as tfdist-k8s options, e.g. '--chief 1 --workers 2 --ps 1'."""
    counts = zip(("chief", "workers", "ps", "evaluator"), dataclasses.astuple(layout), strict=True)
    return " ".join(f"--{flag} {n}" for flag, n in counts if n or flag == "workers")


@dataclasses.dataclass(frozen=True)
class Resources:
    """What each pod asks Kubernetes for; None or 0 leaves it to the cluster's defaults.

    Each becomes both the container's request (what the scheduler reserves for it) and its
    limit (what it may use), so a pod is never placed on a node that cannot hold it, and with
    both CPU and memory set it gets the Guaranteed QoS class (evicted last under pressure).

    Args:
      cpu: CPU cores as a Kubernetes quantity, e.g. "4" or "500m".
      memory: memory as a Kubernetes quantity, e.g. "8Gi".
      gpus: NVIDIA GPUs ("nvidia.com/gpu") for each pod that computes: workers, the
        evaluator, and the chief unless it only coordinates parameter-server training.
    """

    cpu: str | None = None
    memory: str | None = None
    gpus: int = 0

    def __post_init__(self):
        for field, pattern, example in (("cpu", _CPU, "4 or 500m"), ("memory", _MEMORY, "8Gi")):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, str) and pattern.fullmatch(value)):
                raise ManifestError(
                    f"{field} is not a Kubernetes quantity: expected e.g. {example}. "
                    f"Received: {field}={value!r}"
                )
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int):
            raise ManifestError(f"gpus must be a whole number. Received: gpus={self.gpus!r}")
        if self.gpus < 0:
            raise ManifestError(f"gpus must be 0 or more. Received: gpus={self.gpus}")

    def limits(self, *, with_gpus: bool) -> dict[str, Any]:
        """The container's resource limits; GPUs only where `with_gpus`."""
        limits: dict[str, Any] = {}
        if self.cpu is not None:
            limits["cpu"] = self.cpu
        if self.memory is not None:
            limits["memory"] = self.memory
        if with_gpus and self.gpus:
            limits["nvidia.com/gpu"] = self.gpus
        return limits

    def requirements(self, *, with_gpus: bool) -> dict[str, Any]:
        """The container's ``resources``: requests equal to the limits; {} when none are set."""
        limits = self.limits(with_gpus=with_gpus)
        if not limits:
            return {}
        # Two dicts, not one: a shared one would come out of PyYAML as an &id anchor.
        return {"requests": dict(limits), "limits": limits}


@dataclasses.dataclass(frozen=True)
class TrainingJob:
    """A training job to run on Kubernetes, validated when built.

    Every pod runs `command`; with the program's default ``--strategy=auto`` each one
    takes its role from the cluster the engine describes to it.

    Example:

        job = TrainingJob(name="digits", image="example.com/tfdist:1",
                          command=("python", "my_train.py"), layout=Layout(workers=2))

    Args:
      name: the job's name; pods, host names and Services start with it, so it must be a
        DNS-1035 label (lower-case letters, digits, '-'; starts with a letter). Each writer
        also checks that its longest generated name fits in 63 characters.
      image: the container image; it must hold tfdist and the training program.
      command: the program and its arguments, run in every pod, e.g.
        ("python", "-m", "experiments.train", "--config=digits_cnn"). Its ``--strategy``
        flag, if any, must fit the layout.
      layout: how many chief, worker, ps and evaluator tasks (one pod each).
      namespace: the Kubernetes namespace.
      port: the port every task's gRPC server listens on.
      resources: CPU, memory and GPUs per pod.
      workdir: the container's working directory, if the image's is not the right one.
      run_as_user: the user id every container runs as (never root: 0 is refused); the
        image's files the program reads must be readable by it.
      model_dir_claim: a PersistentVolumeClaim to mount at the command's local
        ``--model_dir`` in every pod (so ReadWriteMany, unless all pods share a node).

    Raises:
      ManifestError: a value Kubernetes would refuse, a command with no program, or a
        command whose ``--model_dir`` is a path in the pod with no `model_dir_claim` to keep it.
      tfdist.layout.LayoutError: a layout no TensorFlow job can run, or one the command's
        ``--strategy`` cannot run.
    """

    name: str
    image: str
    command: tuple[str, ...]
    layout: Layout = Layout(workers=1)
    namespace: str = "default"
    port: int = DEFAULT_PORT
    resources: Resources = Resources()
    workdir: str | None = None
    run_as_user: int = DEFAULT_RUN_AS_USER
    model_dir_claim: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "command", tuple(self.command))
        self._check_command()
        validate_layout(self.layout, strategy=self.strategy_flag, spell=k8s_flags)
        if not isinstance(self.name, str) or not _DNS_1035_LABEL.fullmatch(self.name):
            raise ManifestError(
                "name must be a DNS-1035 label, since it starts every pod's host name: "
                "lower-case letters, digits and '-', starting with a letter and not ending "
                f"with '-', e.g. digits-cnn. Received: name={self.name!r}"
            )
        if not isinstance(self.namespace, str) or not (
            _DNS_1123_LABEL.fullmatch(self.namespace) and len(self.namespace) <= MAX_LABEL
        ):
            raise ManifestError(
                "namespace must be a DNS-1123 label: lower-case letters, digits and '-', at "
                f"most 63 characters, e.g. default. Received: namespace={self.namespace!r}"
            )
        if (
            not isinstance(self.image, str)
            or not self.image
            or any(c.isspace() for c in self.image)
        ):
            raise ManifestError(
                "image must name a container image, e.g. example.com/tfdist:1, with no spaces. "
                f"Received: image={self.image!r}"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ManifestError(f"port must be an integer. Received: port={self.port!r}")
        if not 1 <= self.port <= 65535:
            raise ManifestError(f"port must be from 1 to 65535. Received: port={self.port}")
        if self.workdir is not None and not str(self.workdir).startswith("/"):
            raise ManifestError(
                "workdir must be an absolute path in the image, e.g. /app. "
                f"Received: workdir={self.workdir!r}"
            )
        if (
            isinstance(self.run_as_user, bool)
            or not isinstance(self.run_as_user, int)
            or self.run_as_user < 1
        ):
            raise ManifestError(
                "run_as_user must be a user id of 1 or more: the pods run as a non-root user "
                "(runAsNonRoot), so root (0) is refused; use the id the image's files belong "
                f"to, e.g. {DEFAULT_RUN_AS_USER}. Received: run_as_user={self.run_as_user!r}"
            )
        self._check_model_dir()

    @property
    def strategy_flag(self) -> str | None:
        """The value of the command's ``--strategy`` flag, if it has one."""
        return flag_value(self.command, "strategy")

    @property
    def model_dir_path(self) -> str | None:
        """The command's ``--model_dir`` when it is a path in the pod (not gs://, s3://, ...)."""
        value = flag_value(self.command, "model_dir")
        if not value:
            return None
        match = _URL.match(value)
        if match is None:
            return value
        return value[len(match.group(0)) :] if match.group(1).lower() == "file" else None

    def computes(self, task_type: str) -> bool:
        """Whether `task_type`'s pods do the math (and so get the GPUs asked for).

        Under parameter-server training the chief only coordinates and ps only hold
        variables: GPUs there would sit idle.
        """
        if task_type == "ps":
            return False
        return task_type != "chief" or not self.layout.ps

    def pod_spec(
        self, *, port_name: str, env: Sequence[dict[str, Any]], task_type: str
    ) -> dict[str, Any]:
        """The spec of `task_type`'s pods: the locked-down container, and its volumes.

        The writers add their engine's own fields (a restart policy) beside these.
        """
        volumes: list[dict[str, Any]] = [{"name": SCRATCH_VOLUME, "emptyDir": {}}]
        if self.model_dir_claim:
            volumes.append(
                {
                    "name": MODEL_DIR_VOLUME,
                    "persistentVolumeClaim": {"claimName": self.model_dir_claim},
                }
            )
        return {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": self.run_as_user,
                # The claim's files become writable by the user's group (fsGroup); only when
                # the volume's root does not already match, so a large volume is not walked
                # at every start.
                "fsGroup": self.run_as_user,
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [self.container(port_name=port_name, env=env, task_type=task_type)],
            "volumes": volumes,
        }

    def container(
        self, *, port_name: str, env: Sequence[dict[str, Any]], task_type: str
    ) -> dict[str, Any]:
        """The training container of `task_type`'s pods, as a manifest dict."""
        container: dict[str, Any] = {"name": CONTAINER_NAME, "image": self.image}
        if self.workdir:
            container["workingDir"] = self.workdir
        container["command"] = list(self.command)
        container["ports"] = [{"name": port_name, "containerPort": self.port}]
        # Copies: a tree with shared parts would come out of PyYAML with &id anchors. HOME
        # goes where the pod can write: the image's may be root's, or not exist for this user.
        container["env"] = [*copy.deepcopy(list(env)), {"name": "HOME", "value": SCRATCH_DIR}]
        resources = self.resources.requirements(with_gpus=self.computes(task_type))
        if resources:
            container["resources"] = resources
        container["securityContext"] = {
            "runAsNonRoot": True,
            "runAsUser": self.run_as_user,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
            # TensorFlow writes only to /tmp and HOME, both on the scratch volume below.
            "readOnlyRootFilesystem": True,
        }
        mounts = [{"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}]
        if self.model_dir_claim:
            mounts.append({"name": MODEL_DIR_VOLUME, "mountPath": self.model_dir_path})
        container["volumeMounts"] = mounts
        return container

    def check_name_fits(self, longest: str, *, what: str) -> None:
        """Raises ManifestError if `longest`, a name built from the job's, passes 63 characters.

        Args:
          longest: the longest name the writer derives from `name`.
          what: what that name is, for the message, e.g. "pod and Service name".
        """
        if len(longest) > MAX_LABEL:
            raise ManifestError(
                f"name is too long: the {what} {longest!r} has {len(longest)} characters and "
                f"Kubernetes allows {MAX_LABEL}; shorten the name to at most "
                f"{MAX_LABEL - len(longest) + len(self.name)}. Received: name={self.name!r}"
            )

    def _check_model_dir(self) -> None:
        claim, path = self.model_dir_claim, self.model_dir_path
        if claim is not None and not (
            isinstance(claim, str)
            and len(claim) <= MAX_SUBDOMAIN
            and _DNS_1123_SUBDOMAIN.fullmatch(claim)
        ):
            raise ManifestError(
                "model_dir_claim must name a PersistentVolumeClaim: lower-case letters, digits, "
                f"'-' and '.', e.g. runs. Received: model_dir_claim={claim!r}"
            )
        if path is None:
            if claim is not None:
                raise ManifestError(
                    "model_dir_claim is mounted at the command's --model_dir, but the command "
                    "has no --model_dir in the pod: add e.g. `--model_dir=/mnt/runs/"
                    f"{self.name}` to the command, or drop the claim. "
                    f"Received: model_dir_claim={claim!r}"
                )
            return
        if claim is None:
            raise ManifestError(
                f"--model_dir={path} is a path inside the pod, and whatever a pod writes there "
                "is lost when the pod goes (a restart, a preemption, the job's end): mount a "
                "PersistentVolumeClaim there with --model_dir_claim NAME, or write to a bucket, "
                f"e.g. --model_dir=gs://BUCKET/{self.name}. Received: --model_dir={path}"
            )
        if not path.startswith("/") or posixpath.normpath(path) in ("/", SCRATCH_DIR):
            raise ManifestError(
                "--model_dir must be an absolute path other than / and /tmp to mount "
                f"--model_dir_claim there, e.g. /mnt/runs/{self.name}. Received: --model_dir={path}"
            )

    def _check_command(self) -> None:
        command = self.command
        example = f"`-- {EXAMPLE_COMMAND} --model_dir=gs://BUCKET/{self.name}`"
        if not command:
            raise ManifestError(
                f"no training command: give the program every pod runs after `--`, e.g. {example}"
            )
        if any(not isinstance(arg, str) for arg in command):
            raise ManifestError(f"the command must be strings. Received: command={command!r}")
        if command[0].startswith("-"):
            raise ManifestError(
                f"the command starts with the flag {command[0]!r} instead of a program: put the "
                f"program first, e.g. {example}. Received: command={shlex.join(command)!r}"
            )
