"""tfdist-plan: which layout fits a model in memory and runs fastest on a cluster.

    from tfdist import plan
    cost = plan.ModelCost.of(model)                       # FLOPs, bytes, per layer
    cluster = plan.Cluster.from_file("cluster.toml")      # or plan.Cluster(...)
    for e in plan.plan(plan.Training(cost, batch=512, precision="bfloat16"), cluster):
        print(e.layout.name, e.memory, e.step, e.fits(cluster))

- cluster.py: Cluster, Device (presets: DEVICES), Link, and a cluster from a TOML/JSON file;
- model.py: ModelCost, a Keras model's parameters, and per example each layer's FLOPs and
  activations, counted from its traced operations;
- costs.py: the layouts tfdist runs, the bytes each device holds under each and the step
  time (compute, exchange, bubble) from an alpha-beta model of tfdist's collectives;
- cli.py: the console script, and `--calibrate`: this machine's figures measured.
"""

from tfdist.plan.cluster import DEVICES, Cluster, Device, Link, PlanError
from tfdist.plan.costs import Estimate, Layout, Training, estimate, layouts_for, plan
from tfdist.plan.model import ModelCost, Unit

__all__ = [
    "DEVICES",
    "Cluster",
    "Device",
    "Estimate",
    "Layout",
    "Link",
    "ModelCost",
    "PlanError",
    "Training",
    "Unit",
    "estimate",
    "layouts_for",
    "plan",
]
