"""Kubernetes: manifests for tfdist jobs, and the TF_CONFIG each pod ends up with.

One job description, two engines:

  TrainingJob, Resources, ManifestError    the job: name, image, command, layout (job.py)
  tfjob_manifest                           Kubeflow TFJob, kubeflow.org/v1 (tfjob.py)
  operator_tf_config(s)                    what the TFJob operator writes in each pod
                                           (tfjob_operator.py)
  jobset_manifest, jobset_tf_configs       JobSet, jobset.x-k8s.io/v1alpha2 (jobset.py)
  jobset_tf_config, JobSetEnvError         TF_CONFIG from a JobSet pod's environment
                                           (jobset_env.py; tfdist.cluster_from_environment
                                           calls it inside the pod)
  network_policy                           the NetworkPolicy admitting only a JobSet's or
                                           TFJob's own pods to its ports (network.py)

Every pod runs as a non-root user on a read-only root filesystem (TrainingJob.pod_spec).

The `tfdist-k8s` command is cli.py. Nothing here talks to a cluster or imports TensorFlow
(or PyYAML: only the command line writes YAML).
"""

from tfdist.k8s.job import ManifestError, Resources, TrainingJob, k8s_flags
from tfdist.k8s.jobset import jobset_manifest, jobset_tf_configs
from tfdist.k8s.jobset_env import JobSetEnvError, jobset_tf_config
from tfdist.k8s.network import network_policy
from tfdist.k8s.tfjob import tfjob_manifest
from tfdist.k8s.tfjob_operator import operator_tf_config, operator_tf_configs

__all__ = [
    "JobSetEnvError",
    "ManifestError",
    "Resources",
    "TrainingJob",
    "jobset_manifest",
    "jobset_tf_config",
    "jobset_tf_configs",
    "k8s_flags",
    "network_policy",
    "operator_tf_config",
    "operator_tf_configs",
    "tfjob_manifest",
]
