"""The built-in autoscaler: its decision (``policy.py``, pure) and the signals it reads (``signals.py``)."""
