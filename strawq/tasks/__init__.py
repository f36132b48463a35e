"""The queue and its task states.

The run directory and the producer-side operations, the task states and the one move
between them, leases and the grantor, the collector's and the trainer's epochs,
producer incarnations, the run's finished record, the η policy, turn checkpoints and
the run's on-disk format versions.
"""
