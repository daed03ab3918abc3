"""What every Kubernetes manifest tfdist writes starts from: the job, its pods, and their checks.

A `TrainingJob` says what to run (an image and a command), how many tasks of each type
(a `tfdist.layout.Layout`), and what each pod asks for. The writers (`tfjob.py`, `jobset.py`)
turn it into their engine's manifest and add only their engine's own rules. The layout is
checked by `tfdist.layout.validate_layout`, the one place those rules live; messages spell a
fix as tfdist-k8s options (`k8s_flags`).
"""

from __future__ import annotations

import copy
import dataclasses
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

    They become the container's limits, and Kubernetes sets its requests equal to them.

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

    Raises:
      ManifestError: a value Kubernetes would refuse, or a command with no program.
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

    @property
    def strategy_flag(self) -> str | None:
        """The value of the command's ``--strategy`` flag, if it has one."""
        return flag_value(self.command, "strategy")

    def computes(self, task_type: str) -> bool:
        """Whether `task_type`'s pods do the math (and so get the GPUs asked for).

        Under parameter-server training the chief only coordinates and ps only hold
        variables: GPUs there would sit idle.
        """
        if task_type == "ps":
            return False
        return task_type != "chief" or not self.layout.ps

    def container(
        self, *, port_name: str, env: Sequence[dict[str, Any]], task_type: str
    ) -> dict[str, Any]:
        """The training container of `task_type`'s pods, as a manifest dict."""
        container: dict[str, Any] = {"name": CONTAINER_NAME, "image": self.image}
        if self.workdir:
            container["workingDir"] = self.workdir
        container["command"] = list(self.command)
        container["ports"] = [{"name": port_name, "containerPort": self.port}]
        if env:
            # Copies: a tree with shared parts would come out of PyYAML with &id anchors.
            container["env"] = copy.deepcopy(list(env))
        limits = self.resources.limits(with_gpus=self.computes(task_type))
        if limits:
            container["resources"] = {"limits": limits}
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

    def _check_command(self) -> None:
        command = self.command
        example = f"`-- {EXAMPLE_COMMAND} --model_dir=/mnt/runs/{self.name}`"
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
