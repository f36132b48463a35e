"""Records and names: what the run directory's files hold and how they are named.

Record framing (msgpack metadata, Arrow IPC columns, version, checksum), group records
and their per-token extras, numbered and task names, staleness. Nothing here touches
storage.
"""
