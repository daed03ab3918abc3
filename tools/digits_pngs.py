"""Write scikit-learn's 8x8 digits as PNG files, one sub-folder per class: sample data in the
layout of your own image folder (what keras.utils.image_dataset_from_directory reads).

  python -m tools.digits_pngs --out_dir /tmp/digit_pngs       # 0/00000.png, ..., 9/01796.png
  python -m tools.make_tfrecords --source images:/tmp/digit_pngs --split train --out_dir /tmp/mine
  python -m tools.make_tfrecords --source images:/tmp/digit_pngs --split test --out_dir /tmp/mine
  python -m experiments.train --dataset=tfrecord:/tmp/mine

Pixels are scaled from 0..16 to 0..255 (grayscale, one channel).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def write_pngs(out_dir: str) -> int:
    """Writes every digit to OUT_DIR/<label>/<index>.png; returns how many."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., np.newaxis]
    for label in range(10):
        os.makedirs(os.path.join(out_dir, str(label)), exist_ok=True)
    for index, (image, label) in enumerate(zip(images, digits.target, strict=True)):
        png = tf.io.encode_png(image).numpy()
        with open(os.path.join(out_dir, str(label), f"{index:05d}.png"), "wb") as f:
            f.write(png)
    return len(images)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.digits_pngs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out_dir", required=True, help="folder to write the class folders to")
    args = parser.parse_args(argv)
    try:
        count = write_pngs(args.out_dir)
    except OSError as e:
        print(f"error: cannot write to {args.out_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"Wrote {count} PNG images in 10 class folders under {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
