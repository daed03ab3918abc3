"""ZeRO: each replica keeps a slice of the optimizer's state (stage 1), of the summed gradients
(stage 2), and of the weights themselves (stage 3), as DeepSpeed's ZeRO and PyTorch's FSDP do.

- sharded.py: ShardedUpdate, stages 1 and 2 (an update step hook), and Partition;
- stage3.py: ShardedParameters, stage 3: the weights sharded too, each unit gathered where
  it is read and its gradient reduce-scattered;
- units.py: the units stage 3 gathers at once, and `recompute_activations`.
"""
