"""Outcomes of a reconcile that are not plain success."""
from __future__ import annotations

from tokenfleet_operator.validation import Problem


class InvalidSpec(Exception):
    """The spec is wrong in a way only a user can fix; retrying will not help."""

    def __init__(self, problem: Problem):
        super().__init__(str(problem))
        self.problem = problem


class RetryLater(Exception):
    """Something outside the object is not there yet (a PVC, an API hiccup)."""

    def __init__(self, message: str, delay: float):
        super().__init__(message)
        self.delay = delay
