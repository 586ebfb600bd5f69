"""Planner cost of the FP8 comms: the real bytes per value, scales included."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from loka_torchrec import comms
from loka_torchrec.comms import CommsConfig
from loka_torchrec.comms.planner import CommsCostEstimator


@pytest.mark.parametrize(
    "config, dim, expected",
    [
        (CommsConfig(forward="fp8"), 128, 1 + 4 / 128),
        (CommsConfig(forward="fp8", scale_format="e8m0"), 128, 1 + 1 / 128),
        (CommsConfig(forward="fp8", block_size=32), 128, 1 + 4 / 32),
        (CommsConfig(forward="bf16"), 128, 2.0),
        (CommsConfig(backward="fp8"), 64, 4.0),  # forward stays fp32
    ],
)
def test_bytes_per_value(config, dim, expected):
    assert comms.bytes_per_value(config, "forward", dim) == expected


def test_reduce_scatter_is_costed_as_bf16():
    config = CommsConfig(forward="fp8")
    assert comms.bytes_per_value(config, "forward", 64, comm_op="POOLED_EMBEDDINGS_REDUCE_SCATTER") == 2.0


def _options(estimators, config):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    tables = [EmbeddingBagConfig(name=f"t{d}", embedding_dim=d, num_embeddings=1000, feature_names=[f"f{d}"]) for d in (32, 128)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    topology = Topology(world_size=2, compute_device="cpu")
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=64, estimator=estimators(topology))
    options = enumerator.enumerate(ebc, [comms.LokaEmbeddingBagCollectionSharder(config)])
    return {(o.name, o.sharding_type, o.compute_kernel): o for o in options}


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_estimator_costs_scale_bytes_that_stock_planner_ignores(scale_format):
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    config = CommsConfig(forward="fp8", backward="fp8", scale_format=scale_format)
    stock = _options(lambda topo: [EmbeddingPerfEstimator(topo)], config)
    ours = _options(lambda topo: comms.estimators(config, topo)[:1], config)
    checked = 0
    for key, option in stock.items():
        if option.sharding_type != "table_wise":
            continue
        dim = option.tensor.shape[1]
        expected = comms.bytes_per_value(config, "forward", dim)  # the stock planner assumes 1.0
        for a, b in zip(option.shards, ours[key].shards):
            assert b.perf.fwd_comms == pytest.approx(a.perf.fwd_comms * expected, rel=1e-9)
            assert b.perf.bwd_comms == pytest.approx(a.perf.bwd_comms * expected, rel=1e-9)
            checked += 1
    assert checked >= 2


def test_sharding_planner_builds():
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    planner = comms.sharding_planner(CommsConfig(forward="fp8"), Topology(world_size=2, compute_device="cpu"), batch_size=8)
    assert isinstance(planner, EmbeddingShardingPlanner)


def test_legacy_estimator_interface_scales_comms():
    """TorchRec before SharderData passes live sharders; the comms terms are scaled after the fact."""
    from torchrec.distributed.planner.types import Perf

    class Inner:
        def estimate(self, options, sharder_map=None):
            for o in options:
                for s in o.shards:
                    s.perf = Perf(fwd_compute=1.0, fwd_comms=10.0, bwd_compute=2.0, bwd_comms=20.0)

    sharder = types.SimpleNamespace(qcomm_codecs_registry={"POOLED_EMBEDDINGS_ALL_TO_ALL": object()})
    module = types.SimpleNamespace()

    def option(sharding_type):
        return types.SimpleNamespace(
            module_type_key="ebc", is_pooled=True, sharding_type=sharding_type, module=("m", module),
            shards=[types.SimpleNamespace(size=[10, 64], perf=None)], tensor=torch.empty(10, 64),
        )  # fmt: skip

    config = CommsConfig(forward="fp8", backward="bf16")
    tw, rw = option("table_wise"), option("row_wise")
    estimator = CommsCostEstimator(config, topology=None, inner=Inner())
    estimator.estimate([tw, rw], {"ebc": sharder})
    assert tw.shards[0].perf.fwd_comms == pytest.approx(10.0 * (1 + 4 / 64))
    assert tw.shards[0].perf.bwd_comms == pytest.approx(20.0)  # bf16: the dtype size was right
    assert tw.shards[0].perf.fwd_compute == 1.0
    assert rw.shards[0].perf.fwd_comms == 10.0  # reduce-scatter: bf16 on the wire
