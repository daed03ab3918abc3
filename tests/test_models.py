"""The model zoo: every model fits every image size the datasets produce."""

import numpy as np
import pytest

import tfdist
from tfdist.app import TrainConfig, Trainer
from tfdist.models import ModelError, build_model


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet"])
@pytest.mark.parametrize("shape", [(8, 8, 1), (28, 28, 1), (32, 32, 3)])
def test_models_map_images_to_float32_logits(name, shape):
    model = build_model(
        name, input_shape=shape, num_classes=7, **({"depth": 8} if name == "resnet" else {})
    )
    logits = model(np.zeros((2, *shape), np.float32))
    assert tuple(logits.shape) == (2, 7) and logits.dtype == "float32"


def test_resnet20_has_its_published_size():
    model = build_model("resnet", input_shape=(32, 32, 3), num_classes=10, depth=20)
    assert 0.26e6 < model.count_params() < 0.28e6  # He et al. report 0.27M parameters
    assert len(model.losses) > 0  # L2 weight decay on the kernels


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("vgg", {}, r"Unknown model 'vgg'\. Valid names: mlp, cnn, resnet"),
        ("resnet", {"depth": 21}, r"depth is 6n\+2.*Received: depth=21"),
        ("cnn", {"depth": 20}, r"Model 'cnn' has no option among \['depth'\]"),
    ],
)
def test_bad_models_are_explained(name, options, message):
    with pytest.raises(ModelError, match=message):
        build_model(name, input_shape=(8, 8, 1), num_classes=10, **options)


@pytest.mark.parametrize("optimizer", ["sgd", "lamb"])
def test_resnet_with_batch_norm_trains_under_mirrored(optimizer):
    # Batch norm updates its moving statistics inside replica context: it must work there.
    config = TrainConfig(
        model="resnet", model_options={"depth": 8}, optimizer=optimizer, dataset="synthetic",
        dataset_options={"image_shape": (16, 16, 3), "num_examples": 64}, global_batch_size=16,
        epochs=1, steps_per_epoch=3,
    )  # fmt: skip
    trainer = Trainer(
        config,
        strategy=tfdist.build_strategy("mirrored", cluster=None, devices=("/cpu:0", "/cpu:1")),
    )
    result = trainer.fit()
    assert result.steps == 3 and np.isfinite(result.train_loss) and result.eval_accuracy is not None
