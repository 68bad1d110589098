"""The planner's cluster model (smp/planner/cluster.py, design.md §13.1): device compute, links,
collective costs, profiles as files, and the calibration of this machine."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

import smp
from smp.planner import BUILTIN_CLUSTERS, Cluster, Device, Link, get_cluster
from smp.planner import cluster as cl

GIB = 1024**3


def _device(**changes) -> Device:
    fields = dict(
        name="test device",
        memory_bytes=16 * GIB,
        peak_flops={"bf16": 100e12, "fp32": 10e12},
        memory_bandwidth=1e12,
        matmul_curve=((1e6, 0.1), (1e8, 0.5)),
    )
    fields.update(changes)
    return Device(**fields)


def _cluster(**changes) -> Cluster:
    fields = dict(
        name="test",
        device=_device(),
        num_devices=32,
        devices_per_node=8,
        intra=Link(5e-6, 200e9),
        inter=Link(20e-6, 10e9),
    )
    fields.update(changes)
    return Cluster(**fields)


def test_builtin_profiles_hold_their_data_sheets_numbers():
    assert set(BUILTIN_CLUSTERS) == {"a100-40gb", "a100-80gb", "h100", "h200"}
    expect = {  # memory the driver reports (MiB), dense bf16 peak (TFLOP/s)
        "a100-40gb": (40_960, 312),
        "a100-80gb": (81_920, 312),
        "h100": (81_559, 989),
        "h200": (143_771, 989),
    }
    for name, (mib, tflops) in expect.items():
        c = get_cluster(name)
        assert c.device.memory_bytes == mib * 1024**2
        assert c.device.flops_per_second("bf16") == tflops * 1e12
        assert c.devices_per_node == 8 and c.source
        # Large matmuls reach the published cuBLAS fraction, small ones far less.
        assert 0.7 <= c.device.matmul_efficiency(1e13) <= 0.83
        assert c.device.matmul_efficiency(1e7) < 0.01
    # A node's network per GPU: p4d's EFA is the slowest, NDR the fastest.
    assert get_cluster("a100-40gb").inter.bandwidth < get_cluster("a100-80gb").inter.bandwidth
    assert get_cluster("a100-80gb").inter.bandwidth < get_cluster("h100").inter.bandwidth


def test_device_counts_are_given_per_use():
    c = get_cluster("h100", num_devices=64)
    assert (c.num_devices, c.devices_per_node, c.num_nodes) == (64, 8, 8)
    assert get_cluster("h100", num_devices=64, devices_per_node=4).num_nodes == 16
    assert get_cluster("h100", num_devices=2).num_nodes == 1  # part of one node
    assert BUILTIN_CLUSTERS["h100"].num_devices == 8  # the built-in is not changed


def test_matmul_efficiency_interpolates_in_log_flops_and_is_flat_beyond_the_curve():
    d = _device()
    assert d.matmul_efficiency(1e7) == pytest.approx(0.3)
    assert d.matmul_efficiency(1e5) == pytest.approx(0.1)
    assert d.matmul_efficiency(1e9) == pytest.approx(0.5)
    flops = 2.0 * 1000 * 1000 * 1000
    assert d.matmul_time(1000, 1000, 1000, "bf16") == pytest.approx(flops / (100e12 * 0.5))
    assert d.matmul_time(1000, 1000, 1000, "fp32", batch=3) == pytest.approx(
        3 * flops / (10e12 * 0.5)
    )
    assert d.memory_time(2e12) == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"no peak FLOP/s for dtype 'fp16'.*\['bf16', 'fp32'\]"):
        d.matmul_time(8, 8, 8, "fp16")


def test_groups_inside_a_node_use_its_link_and_groups_across_nodes_share_the_network():
    c = _cluster()
    # tp 8 inside a node; dp over 4 nodes with one rank per node (stride 8).
    assert c.group_nodes(8, 1) == 1 and c.group_link(8, 1) == c.intra
    assert c.group_nodes(4, 8) == 4
    across = c.group_link(4, 8)
    assert across.alpha_s == 20e-6 and across.bandwidth == 10e9
    # Two ranks per node (stride 4, size 8): each node's two ranks use two devices' share.
    assert c.group_nodes(8, 4) == 4 and c.group_link(8, 4).bandwidth == 20e9
    # Never faster than the node's own link.
    assert c.group_link(32, 1).bandwidth == 10e9 * 8 == 80e9
    assert _cluster(inter=Link(20e-6, 100e9)).group_link(32, 1).bandwidth == 200e9


def test_a_groups_node_count_is_the_nodes_its_ranks_sit_on():
    for per_node in (1, 3, 8):
        c = dataclasses.replace(_cluster(), num_devices=96, devices_per_node=per_node)
        for size in (1, 2, 3, 4, 6, 12, 16):
            for stride in (1, 2, 3, 4, 5, 8, 12):
                if size * stride <= 96:
                    nodes = {(i * stride) // per_node for i in range(size)}
                    assert c.group_nodes(size, stride) == len(nodes), (per_node, size, stride)


def test_collectives_cost_what_ring_and_tree_cost_over_the_group_link():
    c = _cluster()
    b = 64 * 1024**2
    assert c.all_reduce_time(b, 1) == 0.0 and c.all_gather_time(b, 1) == 0.0
    # Two ranks in a node: a ring of two steps of B/2 each way.
    assert c.all_reduce_time(b, 2) == pytest.approx(2 * (5e-6 + b / 2 / 200e9))
    # Large buffers: the ring (bandwidth-optimal) is cheaper than the tree.
    n = 8
    ring = 2 * (n - 1) * (5e-6 + b / n / 200e9)
    assert c.all_reduce_time(b, n) == pytest.approx(ring)
    # Small buffers over many ranks: the tree's 2 log2 n latencies beat the ring's 2 (n - 1).
    small = 1024
    link = c.group_link(32, 1)
    tree = 2 * math.log2(32) * link.alpha_s + 2 * small / link.bandwidth
    assert c.all_reduce_time(small, 32) == pytest.approx(tree)
    assert tree < 2 * 31 * (link.alpha_s + small / 32 / link.bandwidth)
    # All-gather and reduce-scatter: n - 1 steps of B/n.
    assert c.all_gather_time(b, 4, 8) == pytest.approx(3 * (20e-6 + b / 4 / 10e9))
    assert c.reduce_scatter_time(b, 4, 8) == c.all_gather_time(b, 4, 8)
    assert c.p2p_time(b) == pytest.approx(5e-6 + b / 200e9)
    assert c.p2p_time(b, across_nodes=True) == pytest.approx(20e-6 + b / 10e9)


def test_a_collective_latency_and_bandwidth_of_their_own():
    link = Link(1e-4, 3e9, collective_alpha_s=5e-4, collective_bandwidth=1.2e9)
    c = _cluster(num_devices=2, devices_per_node=2, intra=link, inter=link)
    b = 8 * 1024**2
    assert c.all_reduce_time(b, 2) == pytest.approx(2 * 5e-4 + b / 1.2e9)
    assert c.p2p_time(b) == pytest.approx(1e-4 + b / 3e9)


def test_fits_recover_the_alpha_beta_that_made_the_times():
    sizes = (4, 4096, 65536, 1 << 20, 8 << 20)
    link = cl._fit_link({s: 80e-6 + s / 2.5e9 for s in sizes})
    assert link.alpha_s == pytest.approx(80e-6) and link.bandwidth == pytest.approx(2.5e9)
    both = cl._fit_collective(link, {s: 2 * 6e-4 + s / 1.1e9 for s in (4096, 1 << 20, 8 << 20)})
    assert both.collective_alpha_s == pytest.approx(6e-4)
    assert both.collective_bandwidth == pytest.approx(1.1e9)
    assert (both.alpha_s, both.bandwidth) == (link.alpha_s, link.bandwidth)


def test_profiles_round_trip_through_json_by_contents(tmp_path):
    original = get_cluster("a100-80gb", num_devices=16)
    original = Cluster(**{**vars(original), "measured": {"note": [1, 2]}})
    path = tmp_path / "profiles" / "mine.json"
    original.save(path)
    loaded = get_cluster(str(path))
    assert loaded == original and loaded is not original
    assert json.loads(path.read_text()) == original.to_dict()
    assert get_cluster(original.to_dict()) == original
    assert get_cluster(path, num_devices=32).num_devices == 32


def test_bad_profiles_and_names_are_refused_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match=r"unknown cluster 'h1000'.*a100-40gb.*this-machine"):
        get_cluster("h1000")
    with pytest.raises(ValueError, match=r"no cluster profile at '.*missing.json'"):
        get_cluster(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"12 devices do not fill whole nodes of 8"):
        get_cluster("h100", num_devices=12)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json' is not JSON"):
        get_cluster(str(bad))
    data = get_cluster("h100").to_dict()
    bad.write_text(json.dumps({**data, "format": 99}))
    with pytest.raises(ValueError, match=r"format 99.*calibrate again"):
        get_cluster(str(bad))
    del data["intra"]
    with pytest.raises(ValueError, match=r"not a cluster profile"):
        get_cluster(data)
    with pytest.raises(ValueError, match=r"FLOPs must increase"):
        _device(matmul_curve=((1e8, 0.5), (1e6, 0.1)))
    with pytest.raises(ValueError, match=r"efficiency in \(0, 1\]"):
        _device(matmul_curve=((1e6, 1.5),))
    with pytest.raises(ValueError, match=r"overlap must be in \[0, 1\], got 2"):
        _cluster(overlap=2)
    with pytest.raises(ValueError, match=r"bandwidth > 0"):
        Link(1e-6, 0)


@pytest.mark.timeout(180)
def test_this_machine_is_calibrated_on_first_use_and_then_read_back(tmp_path, monkeypatch, capsys):
    assert smp.calibrate_cluster is cl.calibrate_cluster  # the public name
    monkeypatch.setenv("SMP_CACHE_DIR", str(tmp_path))
    measured = get_cluster("this-machine")
    saved = tmp_path / "cluster-this-machine.json"
    assert saved.exists()
    assert "smp: calibrating this machine: gloo between two processes" in capsys.readouterr().err
    cores = os.cpu_count()
    assert measured.num_devices == measured.devices_per_node == cores
    d = measured.device
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert d.memory_bytes == physical // cores
    # What a rank holds before any model: an interpreter with torch and a gloo group.
    assert 50 * 1024**2 < d.reserved_bytes < 2 * GIB
    assert d.peak_flops["fp32"] > 1e8 and d.peak_flops["bf16"] > 1e7
    assert max(e for _, e in d.matmul_curve) == 1.0  # efficiency relative to the best size
    assert d.memory_bandwidth > 1e8
    link = measured.intra
    assert link == measured.inter and 0 < link.alpha_s < 0.01 and link.bandwidth > 1e7
    assert link.collective_alpha_s is not None and link.collective_bandwidth is not None
    times = measured.measured["p2p_s"]
    assert set(times) == {str(s) for s in cl._P2P_SIZES}
    # The errors kept are the fitted models' against the times kept.
    for size, seconds in times.items():
        error = measured.measured["p2p_model_error"][size]
        assert error == pytest.approx(link.time(int(size)) / seconds - 1)
    # Read back by contents, not measured again.
    monkeypatch.setattr(cl, "calibrate_cluster", lambda *a, **k: pytest.fail("calibrated twice"))
    assert get_cluster("this-machine") == measured
