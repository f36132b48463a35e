"""The data side: from prompt datasets to released tasks.

Datasets and tokenizers, the dataset cursor and what it binds to, the feeder and the
release planner, mixtures, the per-prompt history and the prompt policy.
"""
