"""What the leader remembers of a service between passes: the autoscaler's recent recommendations (its
stabilization windows) and the service's price over time (to price a window of tokens). Kept in memory only:
a new leader starts afresh, and the autoscaler's scale-down waits until it has watched a whole window."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet_operator.autoscale.measure import PriceHistory
from tokenfleet_operator.autoscale.policy import History


@dataclass
class ServiceMemory:
    recommendations: History = field(default_factory=History)
    prices: PriceHistory = field(default_factory=PriceHistory)
