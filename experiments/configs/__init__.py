"""Experiment recipes: each module's docstring gives its command and the result to expect.

A recipe's get_config() returns TrainConfig fields; flags given explicitly override them.
"""

from experiments.configs import digits_cnn, digits_large_batch, synthetic_resnet

CONFIGS = {
    "digits_cnn": digits_cnn,
    "digits_large_batch": digits_large_batch,
    "synthetic_resnet": synthetic_resnet,
}
