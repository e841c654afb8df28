"""Checkpoints: a run's saved state in one directory, written by Orbax in the background.

The manager (``Checkpoints``) is the one object a trainer holds; the other
modules each do one part of its work: the manifest and the per-leaf digests
that detect damage (manifest, integrity), the lease that refuses a second
writer (lease), the stores and the data position (store), restoring a step
(restore), a pool's shared and local directories (pool, local), a lost local
step taken from a replica (replicas), the recipe settings that build it
(settings), and the errors (errors). ``dew.Checkpoints`` and
``dew.training.Checkpoints`` name the manager.
"""
