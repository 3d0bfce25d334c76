"""Watching a running cluster from outside: ``tqstream status`` (a live terminal view and JSON).

``sample`` holds the pure part (rates from consecutive ``stats()`` samples, the JSON shape),
``view`` draws a sample with rich, ``status`` is the command. Nothing here is imported by the
controller or the storage units, so they never load rich.
"""
