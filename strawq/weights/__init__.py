"""The weight-update channel, on the queue's own filesystem.

The bracket's control records, and the engines' notes of the weights they need.
"""
