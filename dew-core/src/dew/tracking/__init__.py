"""Where a run's reports go: the Tracker protocol, the fan-out, the local journal,
the background channel trackers write through, the console and the loop's progress.

Backends for TensorBoard, MLflow and Weights & Biases live in dew-trackers and
depend on this package alone. ``dew.training`` re-exports the public names.
"""
