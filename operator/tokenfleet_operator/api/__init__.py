"""The tokenfleet.dev/v1alpha1 API as pydantic v2 models.

These models are the single source of truth: ``tokenfleet crds`` renders the
CustomResourceDefinitions in ``crds/`` from them, and the operator parses the
objects it reads with them.
"""
from tokenfleet_operator.api.common import API_VERSION, GROUP, VERSION, Condition
from tokenfleet_operator.api.inference_service import InferenceService, InferenceServiceSpec, InferenceServiceStatus
from tokenfleet_operator.api.slice import Slice, SliceSpec, SliceStatus
from tokenfleet_operator.api.slice_queue import SliceQueue, SliceQueueSpec, SliceQueueStatus
from tokenfleet_operator.api.token_route import TokenRoute, TokenRouteSpec, TokenRouteStatus

RESOURCES = (InferenceService, Slice, SliceQueue, TokenRoute)

__all__ = [
    "GROUP", "VERSION", "API_VERSION", "Condition", "RESOURCES",
    "InferenceService", "InferenceServiceSpec", "InferenceServiceStatus",
    "Slice", "SliceSpec", "SliceStatus",
    "SliceQueue", "SliceQueueSpec", "SliceQueueStatus",
    "TokenRoute", "TokenRouteSpec", "TokenRouteStatus",
]
