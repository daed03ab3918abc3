"""Large-batch SGD on digits: the linear scaling rule with warmup (Goyal et al., 2017).

The learning rate 0.1 is meant for a batch of 64; at a global batch of 512 the linear rule
raises it to 0.8, and 2 warmup epochs ramp up to it so the first steps do not diverge.

  python -m experiments.train --config=digits_large_batch --strategy=mirrored --num_cpu_devices=2

Expect: test accuracy about 0.95 after 40 epochs (80 steps of 512).
"""


def get_config() -> dict:
    return {
        "dataset": "digits",
        "model": "cnn",
        "optimizer": "sgd",
        "momentum": 0.9,
        "learning_rate": 0.1,
        "lr_scaling": "linear",
        "base_batch_size": 64,
        "warmup_epochs": 2.0,
        "lr_schedule": "cosine",
        "global_batch_size": 512,
        "epochs": 40,
    }
