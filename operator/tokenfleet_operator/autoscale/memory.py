"""What the leader remembers of a service between passes: the autoscaler's recent recommendations (its
stabilization windows), the service's price over time (to price a window of tokens) and since when it could
serve (its idle time counts no further back). Kept in memory only: a new leader starts afresh, the autoscaler's
scale-down waits until it has watched a whole window, and its scale to zero until a replica is Ready."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet_operator.autoscale.measure import PriceHistory
from tokenfleet_operator.autoscale.policy import History
from tokenfleet_operator.autoscale.startup import ServingSince


@dataclass
class ServiceMemory:
    recommendations: History = field(default_factory=History)
    prices: PriceHistory = field(default_factory=PriceHistory)
    serving: ServingSince = field(default_factory=ServingSince)
