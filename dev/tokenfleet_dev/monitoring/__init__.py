"""Monitoring as code: scrape targets, alert rules and Grafana dashboards, rendered into manifests/monitoring/.

``tokenfleet monitoring`` writes the files; ``tokenfleet monitoring --check`` fails when they drifted from this code
(a unit test runs it, as for the CRDs). Nothing under manifests/monitoring/ is edited by hand.
"""
