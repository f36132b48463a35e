"""Batches and retention: ready groups handed to the trainer, and what a run keeps.

Batch manifests, packed rank shards, the trainer's commits, what a checkpoint records
of the run, retention (the collection of everything else) and requeue of kept drops.
"""
