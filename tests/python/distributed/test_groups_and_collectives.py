"""smp.init builds the groups of api.md §2 on real processes; object collectives move objects."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _groups_worker(config: dict) -> dict:
    import smp
    from smp import _C

    smp.init(config)
    topo = _C.Topology(
        smp.size(),
        config.get("pipeline_parallel_degree", 1),
        config.get("tensor_parallel_degree", 1),
        config.get("placement_strategy", "cluster"),
    )
    me = smp.rank()
    found = {}
    for name, axis in [
        ("pp", _C.Axis.PP),
        ("tp", _C.Axis.TP),
        ("dp", _C.Axis.DP),
        ("rdp", _C.Axis.RDP),
        ("mp", _C.Axis.MP),
    ]:
        group = getattr(smp, f"get_{name}_process_group")()
        ranks = dist.get_process_group_ranks(group)
        assert ranks == topo.group_of(axis, me), (name, ranks)
        assert getattr(smp, f"{name}_rank")() == topo.rank_in(axis, me)
        assert getattr(smp, f"{name}_size")() == len(ranks)
        found[name] = ranks
    assert dist.get_process_group_ranks(smp.get_world_process_group()) == list(range(smp.size()))
    assert smp.local_rank() == me and smp.local_size() == smp.size()
    return found


def test_worked_example_groups_on_four_ranks(pools):
    # api.md's example at 4 ranks: pp = tp = 2, "cluster" (rank = 2·p + t).
    results = pools.run(
        4, _groups_worker, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}
    )
    assert [r["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["rdp"] for r in results] == [[0], [1], [2], [3]]
    assert [r["dp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["mp"] for r in results] == [[0, 1, 2, 3]] * 4


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"pipeline_parallel_degree": 2},
        {"tensor_parallel_degree": 2, "placement_strategy": "spread"},
        {"pipeline_parallel_degree": 2, "placement_strategy": "PDT"},
    ],
)
def test_groups_match_topology(pools, config):
    pools.run(4, _groups_worker, config)


def _collectives_worker() -> dict:
    import smp

    smp.init({"pipeline_parallel_degree": 2})  # pp groups {0,1},{2,3}; dp groups {0,2},{1,3}
    me = smp.rank()
    out = {}
    # broadcast: the sender calls broadcast, receivers recv_from the sender's index.
    if smp.dp_rank() == 0:
        smp.broadcast({"from": me, "payload": list(range(5))}, smp.DP_GROUP)
        out["broadcast"] = None
    else:
        out["broadcast"] = smp.recv_from(0, smp.DP_RANK)
    # send / recv_from in pp coordinates, both directions.
    if smp.pp_rank() == 0:
        smp.send(("ping", me), 1, smp.PP_RANK)
        out["pp"] = smp.recv_from(1, smp.PP_RANK)
    else:
        out["pp"] = smp.recv_from(0, smp.PP_RANK)
        smp.send(("pong", me), 0, smp.RankType.PP_RANK)
    # world ranks
    if me == 3:
        smp.send("to zero", 0)
    if me == 0:
        out["world"] = smp.recv_from(3, smp.WORLD_RANK)
    out["allgather"] = smp.allgather(me * 10, smp.WORLD)
    out["allgather_pp"] = smp.allgather(me, smp.PP_GROUP)
    smp.barrier()
    smp.barrier(smp.TP_GROUP)
    return out


def test_object_collectives(pools):
    r = pools.run(4, _collectives_worker)
    assert [x["broadcast"] for x in r] == [
        None,
        None,
        {"from": 0, "payload": [0, 1, 2, 3, 4]},
        {"from": 1, "payload": [0, 1, 2, 3, 4]},
    ]
    assert [x["pp"] for x in r] == [("pong", 1), ("ping", 0), ("pong", 3), ("ping", 2)]
    assert r[0]["world"] == "to zero"
    assert all(x["allgather"] == [0, 10, 20, 30] for x in r)
    assert [x["allgather_pp"] for x in r] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _bad_peer_worker():
    import smp

    smp.init({})
    errors = []
    for call in (
        lambda: smp.send("x", 5),
        lambda: smp.recv_from(smp.rank()),
        lambda: smp.allgather(1, "nope"),
        lambda: smp.send("x", 0, "bad-type"),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_peers_raise_clear_errors(pools):
    errors = pools.run(2, _bad_peer_worker)[0]
    assert len(errors) == 4
    assert "world rank 5 does not exist" in errors[0]
    assert "itself" in errors[1]
    assert "CommGroup" in errors[2] and "'nope'" in errors[2]
    assert "RankType" in errors[3]


def _degrees_worker():
    import smp

    try:
        smp.init({"pipeline_parallel_degree": 3})
    except ValueError as e:
        return str(e)
    return None


def test_degrees_that_do_not_divide_the_world_fail_on_every_rank(pools):
    for message in pools.run(2, _degrees_worker):
        assert message is not None and "world size 2" in message and "3" in message


def _environment_worker(variable: str, value: str) -> tuple:
    import os

    import smp
    from smp.state import get_state

    os.environ[variable] = value
    try:
        smp.init()
        cfg = get_state().config
        return smp.pp_size(), smp.dp_size(), cfg.microbatches
    finally:
        del os.environ[variable]


@pytest.mark.parametrize("variable", ["SM_HP_MP_PARAMETERS", "SMP_CONFIG"])
def test_init_without_a_dict_reads_the_job_configuration(pools, variable):
    """Under a launcher that sets SMP v1's SM_HP_MP_PARAMETERS (or smp's SMP_CONFIG), smp.init()
    uses it: 2 pipeline stages, not 1 stage x 2 data-parallel ranks."""
    value = '{"partitions": 2, "microbatches": 4, "ddp": true}'
    assert pools.run(2, _environment_worker, variable, value) == [(2, 1, 4)] * 2


class _SeesTracing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x):
        import smp

        self.seen.append(smp.is_tracing())
        return self.b(self.a(x))


def _v1_groups_worker() -> tuple:
    import smp
    from smp.state import get_state

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True})
    ranks = get_state().group_ranks
    getters = {
        "world": smp.get_world_group, "pp": smp.get_pp_group, "tp": smp.get_tp_group,
        "dp": smp.get_dp_group, "rdp": smp.get_rdp_group, "mp": smp.get_mp_group,
    }  # fmt: skip
    for name, getter in getters.items():
        assert getter() == ranks[name], (name, getter(), ranks[name])
    for barrier in (smp.pp_barrier, smp.tp_barrier, smp.dp_barrier, smp.rdp_barrier):
        barrier()
    smp.mp_barrier()
    module = _SeesTracing()
    model = smp.DistributedModel(module)

    @smp.step
    def run(model, x):
        return model(x).sum()

    run(model, torch.ones(2, 4))
    return module.seen


def test_v1_group_getters_barriers_and_is_tracing(pools):
    """get_*_group return rank lists (SMP v1), the *_barrier helpers return on every rank, and
    smp.is_tracing() is True only in the partitioner's tracing pass."""
    seen = pools.run(4, _v1_groups_worker)
    assert any(True in s for s in seen), seen  # a tracing pass ran somewhere
    assert all(s[-1] is False for s in seen if s), seen  # the step's own forward is not tracing
