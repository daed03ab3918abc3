"""tfdist-plan: which layout fits a model in memory and runs fastest on a cluster.

    from tfdist import plan
    cost = plan.ModelCost.of(model)                       # FLOPs, bytes, per layer
    cluster = plan.Cluster.from_file("cluster.toml")      # or plan.Cluster(...)
    for e in plan.plan(plan.Training(cost, batch=512, precision="bfloat16"), cluster):
        print(e.layout.name, e.memory, e.step, e.fits(cluster))

- cluster.py: Cluster, Device (presets: DEVICES), Link, and a cluster from a TOML/JSON file;
- model.py: ModelCost, a Keras model's parameters, and per example each layer's FLOPs and
  activations, counted from its traced operations;
- layouts.py: the layouts tfdist runs (ParallelLayout), and those a job can take;
- costs.py: the bytes each device holds under each layout and the step time (compute,
  exchange, bubble) from an alpha-beta model of tfdist's collectives;
- calibrate.py: this machine's figures measured (tools/parallel_bench uses it);
- cli.py: the console script.
"""

from tfdist.lazy import lazy_exports

_EXPORTS = {
    "DEVICES": "tfdist.plan.cluster",
    "Cluster": "tfdist.plan.cluster",
    "Device": "tfdist.plan.cluster",
    "Link": "tfdist.plan.cluster",
    "PlanError": "tfdist.plan.cluster",
    "Estimate": "tfdist.plan.costs",
    "best_choice": "tfdist.plan.costs",
    "ParallelLayout": "tfdist.plan.layouts",
    "Training": "tfdist.plan.costs",
    "estimate": "tfdist.plan.costs",
    "hybrid_layouts": "tfdist.plan.layouts",
    "layouts_for": "tfdist.plan.layouts",
    "plan": "tfdist.plan.costs",
    "recipe": "tfdist.plan.costs",
    "ModelCost": "tfdist.plan.model",
    "Unit": "tfdist.plan.model",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
