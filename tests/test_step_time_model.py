"""benchmarks/step_time_model.py: bytes per collective, predictions that reproduce their own fit and
grow with the ranks, the links between nodes, and the report from e2e results."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model():
    path = os.path.join(ROOT, "benchmarks", "step_time_model.py")
    spec = importlib.util.spec_from_file_location("step_time_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


stm = _model()


def _measured(world=2, step=100.0, a2a=(4.0, 2.0), ar=(16.0, 0.5), auto=False, run="loka"):
    return stm.Measured(recipe="dlrm", run=run, world=world, step_ms=step,
                        kernel_ms={"all_to_all": a2a[0], "all_reduce": ar[0]}, exposed_ms={"all_to_all": a2a[1], "all_reduce": ar[1]},
                        fp8_all_to_all=False, auto_comms=auto, source="f.json")  # fmt: skip


PAYLOAD = stm.Payload("dlrm", embeddings=8e6, gradients=32e6, dense_params=8_000_000)


def test_bytes_a_rank_sends():
    assert stm.ring_all_reduce_bytes(100.0, 2) == 100.0 and stm.ring_all_reduce_bytes(100.0, 4) == 150.0
    assert stm.ring_all_reduce_bytes(100.0, 8) == 175.0
    assert stm.all_to_all_bytes(100.0, 2) == 100.0 and stm.all_to_all_bytes(100.0, 4) == 150.0


def test_a_prediction_at_the_measured_size_is_the_measurement_and_more_ranks_cost_more():
    m = _measured()
    same = stm.predict(m, PAYLOAD, 2)
    assert same.low_ms == pytest.approx(100.0) and same.high_ms == pytest.approx(100.0)
    assert same.kernel_ms == pytest.approx({"all_to_all": 4.0, "all_reduce": 16.0})
    at4, at8 = stm.predict(m, PAYLOAD, 4), stm.predict(m, PAYLOAD, 8)
    # ring: 2 (N - 1) / N grows 1 -> 1.5 -> 1.75 from N = 2; the all-to-all the same way
    assert at4.kernel_ms["all_reduce"] == pytest.approx(24.0) and at8.kernel_ms["all_to_all"] == pytest.approx(7.0)
    # overlap kept: exposed shares 0.5 and 1/32 of the new times; added exposed: all the added time
    assert at4.low_ms == pytest.approx(97.5 + 3.0 + 0.75) and at4.high_ms == pytest.approx(97.5 + 4.0 + 8.5)
    assert 100.0 < at4.low_ms <= at4.high_ms < at8.high_ms


def test_hidden_time_is_bounded_by_the_rest_of_the_step():
    """A collective far longer than the step's other work cannot stay hidden behind it."""
    m = _measured(step=30.0, ar=(16.0, 0.5))
    link = stm.InterNode.given(0.001, None)  # 1 MB/s between nodes: the all-reduce takes ~56 s
    p = stm.predict(m, PAYLOAD, 4, nodes=2, link=link)
    other = 30.0 - 2.5
    assert p.kernel_ms["all_reduce"] == pytest.approx(48e6 / 1e3)
    assert p.low_ms >= sum(p.kernel_ms.values()) and p.low_ms <= p.high_ms
    assert p.low_ms == pytest.approx(other + sum(p.kernel_ms.values()) - other)


def test_across_nodes_the_link_carries_the_remote_share_and_auto_comms_send_fp8():
    link = stm.InterNode(all_to_all=1e3, all_reduce=2e3, fp8_all_to_all_ratio=0.25, label="sockets", source="s.json")
    fixed, auto = _measured(), _measured(auto=True)
    p_fixed = stm.predict(fixed, PAYLOAD, 8, nodes=2, link=link)
    p_auto = stm.predict(auto, PAYLOAD, 8, nodes=2, link=link)
    nvlink = 2 * 8e6 * (4 - 1) / 8 / (stm.all_to_all_bytes(8e6, 2) / 4.0)  # the 3 peers on the node, at the measured rate
    remote = 2 * 8e6 * 4 / 8 / 1e3
    assert p_fixed.kernel_ms["all_to_all"] == pytest.approx(nvlink + remote)
    assert p_auto.kernel_ms["all_to_all"] == pytest.approx(nvlink + 0.25 * remote)
    # the ring all-reduce runs at its slowest link
    assert p_fixed.kernel_ms["all_reduce"] == pytest.approx(stm.ring_all_reduce_bytes(32e6, 8) / 2e3)
    with pytest.raises(ValueError, match="nodes > 1 needs the bandwidth between them"):
        stm.predict(fixed, PAYLOAD, 8, nodes=2)
    with pytest.raises(ValueError, match="world 6, nodes 4: expected world >= 2, a multiple of nodes"):
        stm.predict(fixed, PAYLOAD, 6, nodes=4, link=link)
    with pytest.raises(ValueError, match="--network-gbps: expected a bandwidth > 0"):
        stm.InterNode.given(0.0, None)


def test_targets_parse_and_bad_ones_are_named():
    assert stm.parse_targets("8, 2x4,4x4") == [(8, 1), (8, 2), (16, 4)]
    with pytest.raises(ValueError, match="--targets: expected N or <nodes>x<GPUs per node>, got 'eight'"):
        stm.parse_targets("eight")


def _record(run, world, step, a2a, ar, comms=None):
    per = lambda total: {"forward": 0.0, "backward": 0.0, "outside": total}  # noqa: E731
    return {
        "recipe": "dlrm", "run": run, "seed": 0, "status": "ok", "world_size": world, "median_step_ms": step, "comms": comms,
        "command": "torchrun ... -m loka_job.train model=dlrm",
        "profile": {"comms": {"ms_per_step": {"all_to_all": per(a2a[0]), "all_reduce": per(ar[0]), "other": per(0.0)},
                              "exposed_ms_per_step": {"all_to_all": a2a[1], "all_reduce": ar[1], "other": 0.0, "all": a2a[1] + ar[1]}}},
    }  # fmt: skip


def test_the_report_checks_the_fit_against_the_other_measurement_and_predicts(tmp_path):
    files = []
    for world, (plain, loka) in {2: (20.0, 15.0), 4: (21.0, 16.0)}.items():
        path = tmp_path / f"e2e-{world}gpu.json"
        path.write_text(json.dumps({"device": "GPU", "runs": [
            _record("plain_compile", world, plain, (1.0, 0.5), (2.0, 0.2)),
            _record("loka_compile_default", world, loka, (1.0, 0.5), (2.0, 0.2), comms="forward fp32, backward fp32 (auto, ...)"),
        ]}))  # fmt: skip
        files.append(str(path))
    sockets = tmp_path / "sockets.json"
    sockets.write_text(json.dumps({"device": "GPU", "runs": [
        _record("plain_compile", 4, 60.0, (40.0, 39.0), (3.0, 3.0)),
        _record("loka_compile_default", 4, 30.0, (12.0, 11.0), (3.0, 3.0), comms="forward fp8, backward fp8 (auto, ...)"),
    ]}))  # fmt: skip
    out = tmp_path / "out" / "model"
    stm.main([*files, "--sockets", str(sockets), "--network-gbps", "50", "--targets", "8,2x4", "--all-reduce", "bf16,fp8", "--out", str(out)])
    result = json.loads((tmp_path / "out" / "model.json").read_text())
    md = (tmp_path / "out" / "model.md").read_text()
    check = {(r["run"], r["fitted_at"], r["world"]): r for r in result["check"]}
    assert set(check) == {(run, a, b) for run in ("plain_compile", "loka_compile_default") for a, b in ((2, 4), (4, 2))}
    assert all(r["miss_pct"] >= 0 and (r["miss_pct"] == 0) == r["inside"] for r in check.values())
    links = {link["label"]: link for link in result["links"]}
    assert set(links) == {"sockets", "50 GB/s"} and links["sockets"]["fp8_all_to_all_ratio"] == pytest.approx(12.0 / 40.0)
    rows = result["predictions"]
    measured = [r for r in rows if r["measured_ms"] is not None]
    assert {(r["run"], r["world"]) for r in measured} == {("plain_compile", 4), ("loka_compile_default", 4)}  # fitted at the largest
    across = {(r["run"], r["link"]) for r in rows if r["nodes"] == 2}
    assert ("loka_compile_default + bf16 all-reduce", "sockets") in across and ("plain_compile", "50 GB/s") in across
    fp8 = next(r for r in rows if r["run"] == "plain_compile + fp8 all-reduce" and r["link"] == "sockets")
    fp32 = next(r for r in rows if r["run"] == "plain_compile" and r["link"] == "sockets" and r["nodes"] == 2)
    assert fp8["kernel_ms"]["all_reduce"] == pytest.approx(fp32["kernel_ms"]["all_reduce"] * (1 + 4 / 256) / 4)
    assert not any(r["nodes"] == 1 and "bf16 all-reduce" in r["run"] for r in rows)  # the variant is for links between nodes
    for text in ("## Check: fitted at one measured world size, predicting another", "| dlrm | plain_compile | 2 GPUs | 4 GPUs | 21.00 |",
                 "Between nodes (sockets, measured in `sockets.json`)", "| dlrm | loka_compile_default | 8 | 2 | sockets |", "## Command"):
        assert text in md, text
    with pytest.raises(SystemExit, match="--all-reduce: expected some of bf16, fp8, got int4"):
        stm.main([*files, "--sockets", str(sockets), "--all-reduce", "int4", "--out", str(out)])
    with pytest.raises(SystemExit, match="need --sockets or --network-gbps"):
        stm.main([*files, "--targets", "2x4", "--out", str(out)])


def test_a_run_without_collectives_in_its_profile_is_named():
    record = _record("plain_compile", 2, 20.0, (1.0, 0.5), (2.0, 0.2))
    record["profile"] = {}
    record["source"] = "e2e.json"
    with pytest.raises(ValueError, match=r"dlrm:plain_compile \(e2e.json\): no collectives in its profile"):
        stm.Measured.of(record)
    record = _record("plain_compile", 1, 20.0, (1.0, 0.5), (2.0, 0.2))
    with pytest.raises(ValueError, match="world_size 1: the model needs a multi-GPU run"):
        stm.Measured.of(record)


def test_payload_of_a_recipe_counts_its_pooled_embeddings_and_dense_parameters():
    payload = stm.Payload.of("dlrm")
    # recipes/data/pooled.yaml: batch 256 per rank, 8 tables of dim 64, fp32
    assert payload.embeddings == 256 * 8 * 64 * 4
    assert payload.dense_params > 0 and payload.gradients == 4 * payload.dense_params


def test_a_recipe_of_sequence_features_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="recipe hstu: its data is sequence features, without num_tables"):
        stm.Payload.of("hstu")
