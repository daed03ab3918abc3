"""Command-line tools around tfdist: the local launcher, checkers, converters, benchmarks."""
