"""The router's availability: two pods by default, spread over nodes, replaced one at a time with a surge,
given the drain's time to stop, and a PodDisruptionBudget that lets one go at a time (issue 48, item 4)."""
from tokenfleet_operator.api import InferenceServiceSpec
from tokenfleet_operator.builders.inference_service import desired_children

from harness.operator_samples import isvc_body

ROUTER_SELECTOR = {"tokenfleet.dev/inference-service": "llama", "tokenfleet.dev/role": "router"}


def router_children(**overrides):
    body = isvc_body(**overrides)
    others = desired_children(body, InferenceServiceSpec.model_validate(body["spec"])).others
    deploy = next(m for m in others if m["kind"] == "Deployment")
    budgets = [m for m in others if m["kind"] == "PodDisruptionBudget"]
    return deploy, budgets


def test_two_router_pods_by_default_spread_over_nodes():
    deploy, _ = router_children()
    assert deploy["spec"]["replicas"] == 2
    [spread] = deploy["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"      # a one-node cluster still runs both
    assert spread["labelSelector"] == {"matchLabels": ROUTER_SELECTOR}
    assert ROUTER_SELECTOR.items() <= deploy["spec"]["template"]["metadata"]["labels"].items()


def test_a_rolling_update_surges_and_never_drops_a_ready_router():
    deploy, _ = router_children()
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def test_the_drain_time_reaches_the_router_and_its_grace_period():
    for drain, given in ((30, None), (120, 120)):
        deploy, _ = router_children(**({"routing": {"drainSeconds": given}} if given else {}))
        pod = deploy["spec"]["template"]["spec"]
        command = pod["containers"][0]["command"]
        assert command[command.index("--drain-timeout") + 1] == str(drain)
        assert pod["terminationGracePeriodSeconds"] == drain + 5


def test_a_disruption_budget_owned_by_the_service_lets_one_router_pod_go_at_a_time():
    for replicas in (1, 2, 5):
        _, [pdb] = router_children(routing={"replicas": replicas})
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["metadata"]["name"] == "llama-router" and pdb["metadata"]["namespace"] == "ns"
        assert pdb["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": ROUTER_SELECTOR}}
