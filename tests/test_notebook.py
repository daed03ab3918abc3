"""experiments/colab_tpu.ipynb runs top to bottom on this CPU-only machine, so it cannot rot.

The notebook is executed as a user would run it (a fresh kernel, every cell in order), with
environment variables that keep the run short; its printed output is then checked.
"""

from __future__ import annotations

import json
import re
import sys

import keras
import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO

# One worker runs this module: its tests share costly module fixtures.

NOTEBOOK = REPO / "experiments" / "colab_tpu.ipynb"
EPOCHS = 5
# The cnn reached 0.93 after 5 epochs of 22 steps here (0.96-0.98 after the full 10).
MIN_ACCURACY = 0.8


def cell_text(cell) -> str:
    """Everything a code cell printed (stdout and stderr) and the errors it raised."""
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif output["output_type"] == "error":
            parts.append("\n".join(output["traceback"]))
    return "".join(parts)


def test_the_committed_notebook_has_no_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert json.loads(NOTEBOOK.read_text())["metadata"]["kernelspec"]["name"] == "python3"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after a short run on CPU: (its cells, the run's model directory)."""
    work = tmp_path_factory.mktemp("notebook")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TFDIST_NOTEBOOK_EPOCHS", str(EPOCHS))
        env.setenv("TFDIST_NOTEBOOK_MODEL_DIR", str(work / "run"))
        env.setenv("TFDIST_DATA_DIR", str(work / "data"))
        for name in ("TF_CONFIG", "TPU_NAME", "COLAB_TPU_ADDR"):
            env.delenv(name, raising=False)
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        # Which interpreter the kernel runs: it must be this one (the venv tfdist is in).
        notebook.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
        client = NotebookClient(
            notebook,
            timeout=240,
            kernel_name="python3",
            resources={"metadata": {"path": str(work)}},
        )
        client.execute()  # raises CellExecutionError, with the cell's traceback, if one fails
    return notebook.cells, work / "run"


def printed(cells) -> str:
    return "".join(cell_text(c) for c in cells if c.cell_type == "code")


@pytest.mark.xdist_group("notebook")
def test_the_kernel_is_this_interpreter(executed):
    cells, _ = executed
    assert cell_text(cells[-1]).strip() == sys.executable


@pytest.mark.xdist_group("notebook")
def test_notebook_skips_the_install_and_says_it_falls_back_from_tpu(executed):
    text = printed(executed[0])
    assert "tfdist is already installed; skipping the install." in text
    assert "This runtime has the CPU only." in text
    assert re.search(r"No TPU strategy: No TPU found.*Runtime > Change runtime type > TPU", text)
    assert "Falling back to one_device on the CPU only." in text
    assert "Global batch 64 = 1 replica(s) x 64 per replica (one_device)" in text
    assert "steps_per_execution=1, mixed_precision=float32" in text
    assert f"22 steps per epoch x {EPOCHS} epochs" in text


@pytest.mark.xdist_group("notebook")
def test_notebook_trains_plots_and_saves_a_model_that_reloads(executed):
    cells, model_dir = executed
    text = printed(cells)
    trained = re.search(r"Trained (\d+) steps .* test accuracy ([0-9.]+)", text)
    assert trained, text[-3000:]
    assert int(trained.group(1)) == 22 * EPOCHS
    accuracy = float(trained.group(2))
    assert accuracy > MIN_ACCURACY
    # One epoch line per epoch, printed by Keras's progress bar under tfdist.fit.
    assert len(re.findall(r"^Epoch \d+/\d+$", text, flags=re.M)) == EPOCHS
    assert len(re.findall(r"^22/22 - .* val_accuracy: ", text, flags=re.M)) == EPOCHS
    # The learning curve was drawn (a PNG in the cell's output) and saved.
    assert any(
        "image/png" in output.get("data", {})
        for cell in cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert (model_dir / "learning_curve.png").stat().st_size > 0
    # Reloaded on the host, the saved model scores what training reported.
    reloaded = re.search(r"Reloaded: test accuracy ([0-9.]+) on 359 test examples", text)
    assert reloaded and float(reloaded.group(1)) == pytest.approx(accuracy, abs=1e-3)
    model = keras.models.load_model(model_dir / "digits_cnn.keras")
    logits = model.predict(np.zeros((2, 8, 8, 1), np.float32), verbose=0)
    assert logits.shape == (2, 10)
