"""A small Keras model zoo by name, for image classification.

Every model maps [batch, H, W, C] float images to [batch, num_classes] float32 logits, and
works for 8x8 (digits), 28x28 (MNIST) and 32x32 (CIFAR) inputs. Build models inside the
strategy's scope (the trainer does) so their variables are distributed.

    >>> model = build_model("resnet", input_shape=(32, 32, 3), num_classes=10, depth=20)

  mlp     two hidden layers
  cnn     three 3x3 convolutions and global pooling; no dropout or batch norm, so synchronous
          data parallelism reproduces one device exactly
  resnet  CIFAR-style ResNet (He et al., 2016): depth 6n+2 (20, 32, 44, 56, 110), batch norm,
          L2 weight decay on the kernels
"""

from __future__ import annotations

from collections.abc import Callable

import keras
from keras import layers

from tfdist.errors import TfdistError


class ModelError(TfdistError, ValueError):
    """A model name or option that cannot be built."""


def _logits(x, num_classes: int):
    # Under mixed precision the last layer still produces float32 logits, so the softmax
    # cross-entropy does not overflow in float16.
    return layers.Dense(num_classes, dtype="float32", name="logits")(x)


def mlp(*, input_shape, num_classes: int, hidden: tuple[int, ...] = (256, 128)) -> keras.Model:
    inputs = keras.Input(input_shape)
    x = layers.Flatten()(inputs)
    for i, units in enumerate(hidden):
        x = layers.Dense(units, activation="relu", name=f"dense_{i}")(x)
    return keras.Model(inputs, _logits(x, num_classes), name="mlp")


def cnn(*, input_shape, num_classes: int, width: int = 32) -> keras.Model:
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    x = layers.Conv2D(2 * width, 3, padding="same", activation="relu")(x)
    # Down-sample once for digits' 8x8, twice for 28x28 and 32x32 inputs.
    x = layers.MaxPooling2D(2)(x)
    if min(input_shape[:2]) >= 16:
        x = layers.MaxPooling2D(2)(x)
    x = layers.Conv2D(4 * width, 3, padding="same", activation="relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(4 * width, activation="relu")(x)
    return keras.Model(inputs, _logits(x, num_classes), name="cnn")


def resnet(
    *, input_shape, num_classes: int, depth: int = 20, weight_decay: float = 1e-4
) -> keras.Model:
    if depth < 8 or (depth - 2) % 6:
        raise ModelError(
            f"A CIFAR ResNet's depth is 6n+2 (e.g. 20, 32, 44, 56, 110). Received: depth={depth}"
        )
    blocks = (depth - 2) // 6
    regularizer = keras.regularizers.L2(weight_decay) if weight_decay else None

    def conv(filters, strides=1):
        return layers.Conv2D(
            filters, 3, strides=strides, padding="same", use_bias=False,
            kernel_initializer="he_normal", kernel_regularizer=regularizer,
        )  # fmt: skip

    inputs = keras.Input(input_shape)
    x = layers.ReLU()(layers.BatchNormalization()(conv(16)(inputs)))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(blocks):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = layers.ReLU()(layers.BatchNormalization()(conv(filters, strides)(x)))
            y = layers.BatchNormalization()(conv(filters)(y))
            if strides != 1:  # option B: a 1x1 projection where the shape changes
                shortcut = layers.Conv2D(
                    filters, 1, strides=strides, use_bias=False, kernel_regularizer=regularizer
                )(x)
                shortcut = layers.BatchNormalization()(shortcut)
            x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, _logits(x, num_classes), name=f"resnet{depth}")


_MODELS: dict[str, Callable[..., keras.Model]] = {"mlp": mlp, "cnn": cnn, "resnet": resnet}


def model_names() -> list[str]:
    return list(_MODELS)


def build_model(name: str, *, input_shape, num_classes: int, **options) -> keras.Model:
    """Builds the model called `name`.

    Args:
      name: 'mlp', 'cnn' or 'resnet'.
      input_shape: (height, width, channels) of one image.
      num_classes: size of the logits.
      **options: the model's own options (mlp: hidden; cnn: width; resnet: depth,
        weight_decay).

    Raises:
      ModelError: unknown name or option.
    """
    if name not in _MODELS:
        raise ModelError(
            f"Unknown model {name!r}. Valid names: {', '.join(_MODELS)}. Received: name={name!r}"
        )
    try:
        return _MODELS[name](input_shape=tuple(input_shape), num_classes=num_classes, **options)
    except TypeError as e:
        if "unexpected keyword" not in str(e):
            raise
        raise ModelError(f"Model {name!r} has no option among {sorted(options)} ({e}).") from None
