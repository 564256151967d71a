"""The placement benchmark runs end to end on a small cluster and reports consistent numbers."""
from __future__ import annotations

import json

from tokenfleet_dev.bench import placement as bench_placement


def test_small_benchmark_writes_the_documented_fields(tmp_path, capsys):
    out = tmp_path / "placement.json"
    assert bench_placement.main(["--nodes", "320", "--slices", "60", "--repeat", "1", "--seed", "3",
                                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for field in ("placement_seconds", "placed", "accelerators_used", "upper_bound_accelerators", "hardware"):
        assert field in result
    assert result["placed"] + result["unplaced"] == 60
    assert 0 < result["accelerators_used"] <= result["upper_bound_accelerators"] <= result["loose_upper_bound_accelerators"]
    assert "placement seconds" in capsys.readouterr().out


def test_the_upper_bound_counts_disjoint_copies_per_shape():
    # Block of 6 hosts, host 2 down: runs of 2 and 3 usable hosts.
    free = [8, 8, None, 8, 8, 8]
    assert bench_placement._copies_in_block(free, 8, 2, topology=True) == 2
    assert bench_placement._copies_in_block(free, 8, 3, topology=True) == 1
    assert bench_placement._copies_in_block(free, 8, 5, topology=False) == 1
    assert bench_placement._copies_in_block([8, 8, 4], 4, 2, topology=False) == 2  # slots 2, 2, 1 hold two 2-host copies
