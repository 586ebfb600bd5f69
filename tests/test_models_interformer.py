"""The Interformer-style model of the zoo: shapes, gradients to every dense parameter, a layer
against the paper's formulas in float64, the history padding, config errors."""

import math

import pytest
import torch
import torch.nn.functional as F
from torchrec import KeyedJaggedTensor

from loka_job.models.interformer import InterformerConfig, InterformerLayer, build_interformer, right_aligned_history
from loka_job.training.data_spec import DataSpec, TableSpec

CPU = torch.device("cpu")
MAX_LEN = 6


def _spec(dim=16, num_context=3, num_dense=4) -> DataSpec:
    tables = (
        TableSpec("t_item", "hist_item", 50, dim, pooling_factor=MAX_LEN, sequence=True),
        TableSpec("t_item", "cand_item", 50, dim, sequence=True),
        *(TableSpec(f"t_ctx_{i}", f"ctx_{i}", 20, dim) for i in range(num_context)),
    )
    return DataSpec(num_dense=num_dense, tables=tables)


def _batch(spec: DataSpec, batch=8, seed=0):
    """A batch with every history length 1..MAX_LEN (the first sample's is MAX_LEN: every slot is used)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (batch,), generator=g)
    lengths[0] = MAX_LEN
    context = len(spec.pooled_tables)
    keys = ["hist_item", "cand_item", *(t.feature for t in spec.pooled_tables)]
    all_lengths = torch.cat([lengths, torch.ones(batch * (1 + context), dtype=torch.int64)])
    values = torch.randint(0, 20, (int(all_lengths.sum()),), generator=g)
    dense = torch.randn(batch, spec.num_dense, generator=g)
    return dense, KeyedJaggedTensor.from_lengths_sync(keys, values, all_lengths)


def _model(config=None, spec=None, seed=0):
    torch.manual_seed(seed)
    return build_interformer(config or InterformerConfig.small(), spec or _spec(), CPU, embedding_device=CPU)


@pytest.mark.parametrize(
    "config, spec",
    [
        (InterformerConfig.small(), _spec()),
        (InterformerConfig(num_layers=1, dense_tokens=0, head_hidden=()), _spec(num_context=0)),  # no context, no dense token
    ],
)
def test_forward_backward_shapes_and_every_parameter_gets_a_gradient(config, spec):
    model = _model(config, spec)
    dense, kjt = _batch(spec)
    logits = model(dense, kjt)
    assert logits.shape == (8,)
    assert (model.embedding_bag_collection is None) == (not spec.pooled_tables)
    logits.square().mean().backward()
    for name, p in model.over_arch.named_parameters():
        if name.startswith("dense_arch") and not config.dense_tokens:
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_histories_are_right_aligned_and_long_ones_keep_their_most_recent_items():
    lengths = torch.tensor([2, 0, 5, 3])
    values = torch.arange(1.0, 11.0)[:, None] * torch.tensor([[1.0, -1.0]])  # items 1..10, two columns
    padded, valid = right_aligned_history(values, lengths, max_len=3)
    expected = torch.zeros(4, 3, 2)
    start = 0
    for b, n in enumerate(lengths.tolist()):
        items = values[start : start + n][-3:]  # the most recent (at most 3), oldest first
        if len(items):
            expected[b, 3 - len(items) :] = items
        start += n
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)
    assert valid.tolist() == [[False, True, True], [False, False, False], [True, True, True], [True, True, True]]


def _attention(module, query, key, padding):
    """``nn.MultiheadAttention(query, key, key)`` (batch first, ``key_padding_mask``) by its formula."""
    d, heads = module.embed_dim, module.num_heads
    w_q, w_k, w_v = module.in_proj_weight.split(d)
    b_q, b_k, b_v = module.in_proj_bias.split(d)

    def split(t):
        return t.view(t.shape[0], t.shape[1], heads, d // heads).transpose(1, 2)

    q, k, v = split(query @ w_q.T + b_q), split(key @ w_k.T + b_k), split(key @ w_v.T + b_v)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d // heads)).masked_fill(padding[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(query.shape[0], query.shape[1], d)
    return out @ module.out_proj.weight.T + module.out_proj.bias


def _gate(module, z):
    return z * torch.sigmoid(z @ module.gate.weight.T + module.gate.bias)


def test_a_layer_is_the_paper_formula():
    """Cross Arch (self-gated summaries of both sides: CLS, PMA and recent tokens), Interaction
    Arch (dot products and a low-rank DCN of [X, S_sum], then an MLP, residual, LayerNorm) and
    Sequence Arch (the personalized FFN, then masked self-attention) against float64 formulas."""
    torch.manual_seed(0)
    config = InterformerConfig(summary_tokens=2, cls_tokens=2, pma_tokens=3, recent_tokens=2, cross_rank=4)
    layer = InterformerLayer(5, config).double().eval()
    b, n, c, d = 4, 5, config.cls_tokens, config.embedding_dim
    x = torch.randn(b, n, d, dtype=torch.float64)
    s = torch.randn(b, c + MAX_LEN, d, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 2])
    padding = torch.cat([torch.zeros(b, c, dtype=torch.bool), torch.arange(MAX_LEN)[None] < (MAX_LEN - lengths)[:, None]], 1)

    summary = layer.non_sequence_summary
    x_sum = _gate(summary.gate, x.flatten(1) @ summary.compress.weight.T + summary.compress.bias).view(b, 2, d)
    seq = layer.sequence_summary
    pooled = _attention(seq.pma, seq.seeds.expand(b, -1, -1), s, padding)
    recent = torch.where(padding[:, -2:, None], 0.0, s[:, -2:])
    s_sum = _gate(seq.gate, torch.cat([s[:, :c], pooled, recent], 1).flatten(1)).view(b, -1, d)

    arch = layer.interaction
    z = torch.cat([x, s_sum], 1)
    m = z.shape[1]
    gram = torch.einsum("bid,bjd->bij", z, z)
    dots = torch.stack([gram[:, i, j] for i in range(m) for j in range(i + 1, m)], 1)
    flat = z.flatten(1)
    crossed = flat * (flat @ arch.cross.V_kernels[0].T @ arch.cross.W_kernels[0].T + arch.cross.bias[0]) + flat
    x_next = arch.norm(x + arch.mlp(torch.cat([dots, crossed], 1)).view(b, n, d))

    sequence = layer.sequence
    weight = (x_sum.flatten(1) @ sequence.personalize.weight.T + sequence.personalize.bias).view(b, d, d)
    p = s + torch.einsum("bld,bde->ble", F.layer_norm(s, (d,), sequence.ffn_norm.weight, sequence.ffn_norm.bias), weight) / math.sqrt(d)
    normed = F.layer_norm(p, (d,), sequence.attention_norm.weight, sequence.attention_norm.bias)
    s_next = p + _attention(sequence.attention, normed, normed, padding)

    got_x, got_s = layer(x, s, padding)
    torch.testing.assert_close(got_x, x_next)
    torch.testing.assert_close(got_s, s_next)


def test_padding_never_reaches_the_logits():
    """Whatever a padding slot holds (here: slot 0's recency embedding, which only full histories
    use), the logits of samples with shorter histories do not change."""
    spec = _spec()
    model = _model(spec=spec).eval()
    dense, kjt = _batch(spec)
    full = kjt["hist_item"].lengths() == MAX_LEN
    before = model(dense, kjt)
    with torch.no_grad():
        model.over_arch.recency[0].add_(100.0)
    after = model(dense, kjt)
    assert 0 < int(full.sum()) < len(full)
    torch.testing.assert_close(after[~full], before[~full], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after[full], before[full])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_heads": 3}, "InterformerConfig.num_heads (3) must divide embedding_dim (16)"),
        ({"pma_tokens": 0}, "InterformerConfig.pma_tokens must be an int >= 1"),
        ({"dense_tokens": -1}, "InterformerConfig.dense_tokens must be an int >= 0"),
        ({"interaction_hidden": 7}, "InterformerConfig.interaction_hidden must be a sequence of ints"),
        ({"preset": "huge"}, "model.preset must be one of"),
        ({"bogus": 1}, "model: unknown Interformer option(s) ['bogus']"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises((TypeError, ValueError)) as info:
        InterformerConfig.from_options(options)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "config, spec, message",
    [
        (InterformerConfig(), _spec(dim=32), "data.embedding_dim: table 't_item' (feature 'hist_item') is 32 wide"),
        (InterformerConfig(recent_tokens=7), _spec(), "InterformerConfig.recent_tokens (7) must be <= the longest history (data.max_seq_len = 6)"),
        (InterformerConfig(candidate_feature="item"), _spec(), "InterformerConfig.candidate_feature: 'item' is not a sequence feature"),
        (InterformerConfig(), DataSpec(4, (*_spec().tables, TableSpec("t_x", "hist_x", 50, 16, 6, True))),
         "data: the Interformer model reads one history sequence feature besides the candidate, got ['hist_item', 'hist_x']"),
    ],
)
def test_data_that_does_not_fit_names_the_field(config, spec, message):
    with pytest.raises(ValueError) as info:
        _model(config, spec)
    assert message in str(info.value)


def test_docstring_examples_run():
    import doctest

    from loka_job.models import interformer

    result = doctest.testmod(interformer)
    assert result.attempted > 0 and result.failed == 0
