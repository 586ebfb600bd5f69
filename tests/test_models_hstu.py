"""The HSTU-style model: jagged causal attention (no look-ahead, no leaks), shapes, mods."""

import copy
from dataclasses import replace as dataclasses_replace

import pytest
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from loka_job.models.hstu import HstuConfig, JaggedLayout, StuLayer, build_hstu, causal_silu_attention, padded_token_count
from loka_torchrec.mods import BlockNorm, ModsConfig, PaddedLinear, SiblingLinears, apply_mods
from loka_job.training.data_spec import DataSpec, TableSpec

CPU = torch.device("cpu")
MAX_LEN = 6


def _spec(dim=32, num_dense=3, extra_history=False) -> DataSpec:
    tables = [
        TableSpec("t_item", "hist_item", 40, dim, pooling_factor=MAX_LEN, sequence=True),
        TableSpec("t_item", "cand_item", 40, dim, pooling_factor=1, sequence=True),
    ]
    if extra_history:
        tables.append(TableSpec("t_action", "hist_action", 5, dim, pooling_factor=MAX_LEN, sequence=True))
    return DataSpec(num_dense=num_dense, tables=tuple(tables))


def _kjt(histories, candidates, actions=None):
    keys = ["hist_item", "cand_item"] + (["hist_action"] if actions is not None else [])
    values = [i for h in histories for i in h] + list(candidates) + ([a for h in actions for a in h] if actions else [])
    lengths = [len(h) for h in histories] + [1] * len(candidates) + ([len(h) for h in actions] if actions else [])
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor(values), torch.tensor(lengths))


def _model(config=None, spec=None, seed=0):
    torch.manual_seed(seed)
    return build_hstu(config or HstuConfig.small(), spec or _spec(), CPU, embedding_device=CPU)


def _reference_attention(q, k, v, n, max_len):
    """One sequence (n valid tokens) at a time, with explicit loops over i and j <= i, in float64."""
    out = torch.zeros(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1):
            w = torch.nn.functional.silu((q[i] * k[j]).sum(-1) * q.shape[-1] ** -0.5) / max_len  # (H,)
            out[i] += w[:, None] * v[j]
    return out


def test_attention_matches_the_per_sequence_reference_and_ignores_garbage_padding():
    torch.manual_seed(0)
    lengths = torch.tensor([4, 1, 0, 6])
    b, length, heads, a, h = 4, MAX_LEN, 2, 3, 5
    q, k = torch.randn(b, length, heads, a, dtype=torch.float64), torch.randn(b, length, heads, a, dtype=torch.float64)
    v = torch.randn(b, length, heads, h, dtype=torch.float64)
    valid = torch.arange(length)[None, :] < lengths[:, None]
    for t in (q, k, v):  # poison the padding with huge finite values
        t[~valid] = 1e30
    out = causal_silu_attention(q, k, v, lengths, max_len=length)
    for s in range(b):
        n = int(lengths[s])
        expected = _reference_attention(q[s], k[s], v[s], n, length)
        torch.testing.assert_close(out[s, :n], expected[:n], rtol=1e-12, atol=1e-12)
        assert torch.all(out[s, n:] == 0)


def test_a_token_never_reads_a_later_token_or_another_sequence():
    torch.manual_seed(0)
    layer = StuLayer(8, num_heads=2, attention_dim=4, linear_dim=4).double()
    lengths = torch.tensor([3, 2, 4])
    layout = JaggedLayout(lengths, max_len=5)
    x = torch.randn(9, 8, dtype=torch.float64)
    jacobian = torch.autograd.functional.jacobian(lambda t: layer(t, layout), x)  # (9, 8, 9, 8)
    reads = jacobian.abs().sum(dim=(1, 3))  # reads[t, s]: does output token t depend on input token s?
    seq = torch.repeat_interleave(torch.arange(3), lengths)
    pos = torch.cat([torch.arange(int(n)) for n in lengths])
    for t in range(9):
        for s in range(9):
            allowed = bool(seq[t] == seq[s] and pos[s] <= pos[t])
            if allowed:
                assert reads[t, s] > 0, (t, s)
            else:
                assert reads[t, s] == 0, (t, s)


def test_model_logit_depends_only_on_its_own_history():
    model = _model()
    model.eval()
    dense = torch.randn(3, 3)
    base = model(dense, _kjt([[1, 2, 3], [4], [5, 6]], [7, 8, 9])).detach()
    other = model(dense, _kjt([[1, 2, 3], [4, 10, 11, 12, 13, 14], [5, 6]], [7, 8, 9])).detach()
    torch.testing.assert_close(other[[0, 2]], base[[0, 2]], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(other[1], base[1])


def test_forward_backward_shapes_and_gradients():
    model = _model()
    dense = torch.randn(4, 3)
    logits = model(dense, _kjt([[1, 2, 3], [4], [], [5, 6, 7, 8, 9, 10]], [7, 8, 9, 1]))
    assert logits.shape == (4,) and torch.isfinite(logits).all()
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    uvqk = model.over_arch.layers[0].uvqk
    assert isinstance(uvqk, SiblingLinears) and uvqk.names == ("u", "v", "q", "k")


def test_two_history_features_are_summed_and_must_align():
    spec = _spec(extra_history=True)
    model = _model(spec=spec)
    logits = model(torch.randn(2, 3), _kjt([[1, 2], [3]], [4, 5], actions=[[0, 1], [2]]))
    assert logits.shape == (2,)
    with pytest.raises(ValueError, match="same length per sample"):
        model(torch.randn(2, 3), _kjt([[1, 2], [3]], [4, 5], actions=[[0], [2, 1]]))


def test_mods_all_and_the_function_preserving_mods():
    model = _model()
    dense = torch.randn(3, 3)
    kjt = _kjt([[1, 2, 3], [4], [5, 6]], [7, 8, 9])
    exact = copy.deepcopy(model)
    report = apply_mods(exact, ModsConfig(preset="custom", fuse_siblings=True, pad_to_16=True))
    assert report["fuse_siblings"].modules == ("over_arch.layers.0.uvqk", "over_arch.layers.1.uvqk")
    torch.testing.assert_close(exact(dense, kjt), model(dense, kjt), rtol=1e-5, atol=1e-5)
    modded = copy.deepcopy(model)
    apply_mods(modded, ModsConfig(preset="all", block_size=16))
    kinds = {type(m) for m in modded.modules()}
    assert BlockNorm in kinds and nn.Hardswish in kinds and nn.SiLU not in kinds and nn.LayerNorm not in kinds
    assert modded.over_arch.layers[0].uvqk.is_fused
    out = modded(dense, kjt)
    assert out.shape == (3,)
    out.sum().backward()
    assert PaddedLinear in kinds  # the head's 1-wide prediction layer


def test_a_bucketed_layout_puts_each_padding_row_in_its_own_unused_slot():
    lengths = torch.tensor([4, 1, 0, 6, 2])  # T = 13 in a 5 x 6 grid
    layout = JaggedLayout(lengths, max_len=MAX_LEN, bucket=8)
    plain = JaggedLayout(lengths, max_len=MAX_LEN)
    assert (layout.num_tokens, layout.num_real_tokens, plain.num_tokens) == (16, 13, 13)
    assert torch.equal(layout.flat_index[:13], plain.flat_index) and torch.equal(layout.recency[:13], plain.recency)
    padding = layout.flat_index[13:]
    assert padding.unique().numel() == 3 and not layout.valid.flatten()[padding].any()
    assert torch.equal(layout.batch_index[13:] * MAX_LEN + layout.position[13:], padding)
    assert torch.all(layout.recency[13:] == 0)
    # Never more rows than the grid has slots, and no padding when T is a multiple already.
    assert JaggedLayout(lengths, max_len=MAX_LEN, bucket=64).num_tokens == 5 * MAX_LEN
    assert JaggedLayout(torch.tensor([4, 4]), max_len=MAX_LEN, bucket=8).num_tokens == 8
    assert [padded_token_count(t, 2048, 65536) for t in (1, 2048, 2049, 65000)] == [2048, 2048, 4096, 65536]
    assert padded_token_count(37, 0, 65536) == 37


def test_padding_tokens_to_a_bucket_changes_no_logit_and_no_gradient():
    """The bucketed model computes what the unbucketed one does, in float64, gradients included
    (the padding rows get exactly zero gradient, so they add nothing to any weight's)."""
    plain = _model().double()
    bucketed = build_hstu(dataclasses_replace(HstuConfig.small(), token_bucket=8), _spec(), CPU, embedding_device=CPU).double()
    bucketed.load_state_dict(plain.state_dict())
    assert bucketed.compile_static_shapes and not plain.compile_static_shapes
    dense = torch.randn(4, 3, dtype=torch.float64)
    kjt = _kjt([[1, 2, 3], [4], [], [5, 6, 7, 8, 9, 10]], [7, 8, 9, 1])  # T = 10 -> 16 rows
    for model in (plain, bucketed):
        model.zero_grad()
        logits = model(dense, kjt)
        (logits * torch.arange(1.0, 5.0, dtype=torch.float64)).sum().backward()
        model.logits = logits.detach()
    torch.testing.assert_close(bucketed.logits, plain.logits, rtol=1e-12, atol=1e-12)
    grads = dict(plain.named_parameters())
    for name, p in bucketed.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None, name
            continue
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="token_bucket must be an int >= 0"):
        HstuConfig(token_bucket=-1)
    assert HstuConfig.from_options({"preset": "large", "token_bucket": 2048}).token_bucket == 2048


def test_bad_inputs_raise_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="at most 6 ids"):
        model(torch.randn(1, 3), _kjt([[1] * 7], [2]))
    bad_candidates = KeyedJaggedTensor.from_lengths_sync(
        ["hist_item", "cand_item"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 2, 0])
    )
    with pytest.raises(ValueError, match="exactly one id"):
        model(torch.randn(2, 3), bad_candidates)
    with pytest.raises(ValueError, match="candidate_feature"):
        build_hstu(HstuConfig(candidate_feature="target"), _spec(), CPU)
    with pytest.raises(ValueError, match="data.embedding_dim"):
        build_hstu(HstuConfig.small(), _spec(dim=16), CPU)


def test_large_preset_gemm_shapes():
    spec = DataSpec(
        num_dense=8,
        tables=(
            TableSpec("t_item", "hist_item", 10_000, 512, pooling_factor=128, sequence=True),
            TableSpec("t_item", "cand_item", 10_000, 512, pooling_factor=1, sequence=True),
        ),
    )
    model = build_hstu(HstuConfig.large(), spec, torch.device("meta"))
    layer = model.over_arch.layers[0]
    assert layer.uvqk.widths == (512, 512, 512, 512)  # one fused GEMM: K = 512, N = 2048
    assert (layer.out.in_features, layer.out.out_features) == (512, 512)
    assert model.max_len == 128


def test_xl_preset_gemm_shapes_and_a_tiny_batch_at_full_length():
    """D = 1024, 8 heads of 128: one 1024 -> 4096 uvqk GEMM and a 1024 -> 1024 output per layer;
    a batch of two histories (one of the full 512 items) runs forward and backward on the CPU."""
    spec = DataSpec(
        num_dense=13,
        tables=(
            TableSpec("t_item", "hist_item", 100, 1024, pooling_factor=512, sequence=True),
            TableSpec("t_item", "cand_item", 100, 1024, pooling_factor=1, sequence=True),
        ),
    )
    config = dataclasses_replace(HstuConfig.xl(), num_layers=1)  # one layer: the shapes, at a CPU's cost
    model = build_hstu(config, spec, CPU, embedding_device=CPU)
    layer = model.over_arch.layers[0]
    assert layer.uvqk.widths == (1024, 1024, 1024, 1024)  # one fused GEMM: K = 1024, N = 4096
    assert (layer.out.in_features, layer.out.out_features) == (1024, 1024)
    assert model.max_len == 512
    g = torch.Generator().manual_seed(0)
    histories = [torch.randint(0, 100, (512,), generator=g).tolist(), [3, 4, 5]]
    logits = model(torch.randn(2, 13, generator=g), _kjt(histories, [7, 8]))
    assert logits.shape == (2,)
    logits.sum().backward()
    assert layer.uvqk.members["q"].weight.grad is not None and layer.out.weight.grad is not None
    xl = HstuConfig.xl()
    assert (xl.embedding_dim, xl.num_heads, xl.attention_dim, xl.num_layers) == (1024, 8, 128, 4)
    assert HstuConfig.from_options({"preset": "xl"}) == xl
    with pytest.raises(ValueError, match="model.preset must be one of"):
        HstuConfig.from_options({"preset": "huge"})


def test_with_a_token_bucket_the_dense_part_compiles_once_per_bucket_with_static_shapes():
    """``compile_dense`` reads the model's ``compile_static_shapes``: three buckets of tokens give
    three static graphs of each module that sees the tokens (automatic dynamic shapes would stop at
    two, one of them dynamic, which CUDA graphs skip), and batches of buckets seen before compile
    nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from loka_torchrec.compile import RECOMPILE_LIMIT, compile_dense

    torch._dynamo.reset()
    counters.clear()
    # Dynamo's default limit, restored afterwards: compile_dense raises it for static shapes.
    with torch._dynamo.config.patch(recompile_limit=8):
        try:
            config = dataclasses_replace(HstuConfig.small(), num_layers=1, token_bucket=4)
            model = build_hstu(config, _spec(), CPU, embedding_device=CPU)
            names = compile_dense(model, "default")
            assert names == ["over_arch.layers.0", "over_arch.final_norm", "over_arch.dense_arch", "over_arch.head"]
            assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
            histories = {3: [[1, 2], [3]], 5: [[1, 2, 3], [4, 5]], 9: [[1, 2, 3, 4, 5, 6], [7, 8, 9]], 4: [[1], [2, 3, 4]]}
            with torch.no_grad():  # Dynamo's graphs are the same with a backward; Inductor's work is a third
                for total in (3, 5, 9, 4, 5, 9):  # buckets 4, 8, 12, then each again
                    assert torch.isfinite(model(torch.randn(2, 3), _kjt(histories[total], [7, 8]))).all()
            # The layer and the final norm see the tokens (3 buckets each); dense_arch and head the batch.
            assert counters["stats"]["unique_graphs"] == 3 + 3 + 1 + 1, dict(counters["stats"])
            assert counters["graph_break"] == {}
        finally:
            torch._dynamo.reset()
            counters.clear()
