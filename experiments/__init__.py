"""absl training binaries: each parses flags and hands explicit arguments to tfdist."""

import os

# TensorFlow's C++ start-up chatter hides the lines users need. Set here, in the package,
# so it is in place before any binary's imports load TensorFlow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
