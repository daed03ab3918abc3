"""The facade users call: tfdist.fit, tfdist.evaluate and tfdist.predict (fit.py, predict.py).

It sits above the engine (tfdist.training) and the parallel modes (tfdist.parallel), and
reads the modes' keywords from tfdist.parallel.registry; `import tfdist` exposes its names.
"""
