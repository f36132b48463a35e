"""A run seen from outside: status, the glance and its text, Prometheus exposition, and
readable views of single records.
"""
