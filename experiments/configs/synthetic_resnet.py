"""ResNet-20 on synthetic 32x32x3 images: a throughput recipe (labels are random).

  python -m experiments.train --config=synthetic_resnet --strategy=mirrored --num_cpu_devices=2

Expect: no accuracy to speak of (random labels); the final line reports examples/s
(about 500 on 2 cores over 2 logical CPUs).
"""


def get_config() -> dict:
    return {
        "dataset": "synthetic",
        "dataset_options": {"image_shape": (32, 32, 3), "num_examples": 2048},
        "model": "resnet",
        "model_options": {"depth": 20},
        "optimizer": "sgd",
        "learning_rate": 0.1,
        "global_batch_size": 128,
        "epochs": 2,
        "steps_per_epoch": 16,
        "eval_every": 0,
    }
