"""FP8 comm codec: wire format numerics, edge cases, the TorchRec codec protocol and the registry."""

from __future__ import annotations

import logging

import pytest
import torch

from loka_torchrec import comms
from loka_torchrec.comms import CommsConfig, Fp8CommCodec, NonFiniteCounters
from loka_torchrec.fp8 import Fp8Format, quantize
from loka_torchrec.kernels import fp8_comm_codec as wire

FORMATS = ["e4m3", "e5m2"]
SCALES = ["fp32", "e8m0"]


def _blocks(n_blocks: int, block: int, seed: int = 0) -> torch.Tensor:
    """Blocks whose magnitudes span 1e-6 to 1e6: a single tensor-wide scale could not carry them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, block, generator=g, dtype=torch.float64)
    return (x * torch.logspace(-6, 6, n_blocks, dtype=torch.float64)[:, None]).float()


def _bound(x: torch.Tensor, fmt: Fp8Format, scale_format: str) -> torch.Tensor:
    """|decode(encode(x)) - x| <= u |x| + (sub / 2) d per block, d the dequantization scale.

    d = amax / fp8_max for fp32 scales and at most twice that for power-of-two (E8M0) scales; the
    float32 scaling adds a few units of 2**-24.
    """
    x = x.double()
    amax = x.abs().amax(dim=-1, keepdim=True)
    d = amax / fmt.max * (2.0 if scale_format == "e8m0" else 1.0)
    return (fmt.unit_roundoff * x.abs() + fmt.smallest_subnormal / 2 * d) * (1 + 2.0**-20)


# --- the wire format ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale_format", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_format_bound(fmt, scale_format, dtype):
    block = 24
    x = _blocks(40, block).clamp(-6e4, 6e4).to(dtype)  # fp16 cannot hold 1e6
    payload = wire.encode_reference(x, block=block, fmt=fmt, scale_format=scale_format)
    assert payload.dtype == torch.uint8
    assert payload.numel() == 40 * wire.record_bytes(block, scale_format)
    out = wire.decode_reference(payload, block=block, fmt=fmt, scale_format=scale_format).view(40, block)
    err = (out.double() - x.double()).abs()
    assert (err <= _bound(x.float(), Fp8Format(fmt), scale_format)).all()
    # and the bound is not vacuous: the payload really is 8-bit
    assert err.max() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_scales_match_the_project_rowwise_quantizer_bitwise(fmt):
    x = _blocks(16, 32, seed=1)
    ref = quantize(x, fmt, "rowwise").dequantize()
    payload = wire.encode_reference(x, block=32, fmt=fmt, scale_format="fp32")
    assert torch.equal(wire.decode_reference(payload, block=32, fmt=fmt, scale_format="fp32").view(16, 32), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_e8m0_scale_is_the_largest_power_of_two_that_does_not_saturate(fmt):
    f = Fp8Format(fmt)
    amaxes = torch.tensor([1.0, f.max, f.max * 1.0001, 3e-7, 123.456, 2.0**-20, 7e30], dtype=torch.float32)
    x = torch.zeros(len(amaxes), 4)
    x[:, 0] = amaxes
    payload = wire.encode_reference(x, block=4, fmt=fmt, scale_format="e8m0").view(len(amaxes), 5)
    k = 127 - payload[:, 4].double()  # quantization scale 2**k
    assert (amaxes.double() * 2.0**k <= f.max).all()
    assert (amaxes.double() * 2.0 ** (k + 1) > f.max).all()


def test_all_zero_blocks_decode_to_zero_with_finite_scales():
    x = torch.zeros(3, 16)
    x[1] = torch.linspace(-1, 1, 16)
    for scale_format in SCALES:
        payload = wire.encode_reference(x, block=16, fmt="e4m3", scale_format=scale_format)
        out = wire.decode_reference(payload, block=16, fmt="e4m3", scale_format=scale_format).view(3, 16)
        assert torch.equal(out[0], torch.zeros(16)) and torch.equal(out[2], torch.zeros(16))
        assert torch.isfinite(out).all()


def test_empty_payloads():
    codec = Fp8CommCodec("e4m3", block=8)
    ctx = codec.create_context()
    payload = codec.encode(torch.empty(0, 8), ctx)
    assert payload.numel() == 0 and codec.calc_quantized_size(0, ctx) == 0
    assert codec.decode(payload, ctx).numel() == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_values_arrive_nonfinite_and_are_counted(fmt):
    counters = NonFiniteCounters()
    codec = Fp8CommCodec(fmt, block=4, name="op/forward", counters=counters)
    x = torch.tensor([[1.0, float("inf"), -2.0, 0.5], [float("nan"), 3.0, -float("inf"), 0.0], [1, 2, 3, 4]])
    out = codec.decode(codec.encode(x)).view(3, 4)
    nonfinite = ~torch.isfinite(x)
    assert torch.equal(~torch.isfinite(out), nonfinite)
    assert torch.isnan(out[1, 0])
    if fmt == "e5m2":  # E5M2 has infinities: the sign survives
        assert out[0, 1] == float("inf") and out[1, 2] == -float("inf")
    else:  # E4M3FN has none: NaN, never the finite 448 a plain cast gives
        assert torch.isnan(out[0, 1]) and torch.isnan(out[1, 2])
    # the finite values of an affected block keep their accuracy
    finite = torch.isfinite(x)
    assert ((out - x).abs()[finite] <= 2 ** -3 * x.abs()[finite] + 1e-6).all()
    assert counters.as_dict() == {"op/forward/sent": 3, "op/forward/received": 3}
    counters.reset()
    assert counters.total() == 0


def test_payload_splits_at_record_boundaries_and_concatenates():
    """What all_to_all_single does: cut one payload by split sizes, concatenate other senders' pieces."""
    codec = Fp8CommCodec("e4m3", block=8)
    a, b = _blocks(5, 8, seed=2), _blocks(3, 8, seed=3)
    pa, pb = codec.encode(a), codec.encode(b)
    cut = codec.calc_quantized_size(2 * 8)
    mixed = torch.cat([pb, pa[cut:], pa[:cut]])
    expected = torch.cat([codec.decode(pb), codec.decode(pa[cut:]), codec.decode(pa[:cut])])
    assert torch.equal(codec.decode(mixed), expected)
    assert torch.equal(codec.decode(pa[:cut]), codec.decode(pa)[:16])


def test_codec_protocol_shapes_and_dtypes():
    codec = Fp8CommCodec("e4m3", block=16)
    assert codec.quantized_dtype == torch.uint8
    x = torch.randn(6, 32, dtype=torch.bfloat16)  # 2-D input, as TorchRec passes after padding
    ctx = codec.create_context()
    payload = codec.encode(x, ctx)
    assert payload.dim() == 1 and payload.numel() == codec.calc_quantized_size(x.numel(), ctx)
    out = codec.decode(payload, ctx)
    assert out.dtype == torch.bfloat16 and out.shape == (6 * 32,)  # the sender's dtype, flat
    assert codec.decode(payload).dtype == torch.float32  # no context: float32
    assert codec.bytes_per_value == (16 + 4) / 16
    assert "kernel=" in repr(codec) and "block=16" in repr(codec)


def test_partial_block_is_refused_with_a_clear_error():
    codec = Fp8CommCodec("e4m3", block=16)
    with pytest.raises(ValueError, match="not a multiple of the FP8 comm block of 16"):
        codec.calc_quantized_size(24)
    with pytest.raises(ValueError, match="not a multiple"):
        codec.encode(torch.randn(24))
    with pytest.raises(TypeError, match="floating point"):
        codec.encode(torch.arange(16))
    with pytest.raises(ValueError, match="whole number"):
        codec.decode(torch.zeros(7, dtype=torch.uint8))


def test_padded_size_pads_every_rank_to_the_block():
    codec = Fp8CommCodec("e4m3", block=16)
    ctx = codec.create_context()
    x = torch.randn(4, 40)
    assert codec.padded_size(x, [40, 32], 0, ctx) == (48, 8)
    assert ctx.padded_dim_sum_per_rank == [48, 32]
    ctx2 = codec.create_context()
    assert codec.padded_size(torch.randn(4, 32), [40, 32], 1, ctx2) == (32, 0)
    assert ctx2.padded_dim_sum_per_rank == [48, 32]  # rank 1 must know rank 0's padded width
    ctx3 = codec.create_context()
    assert codec.padded_size(torch.randn(4, 32), [32, 64], 0, ctx3) == (32, 0)
    assert ctx3.padded_dim_sum_per_rank is None
    assert codec.padded_size(torch.randn(64), [32, 32], 0, ctx3) == (64, 0)


def test_bf16_codec_keeps_shape_and_counts():
    counters = NonFiniteCounters()
    codec = comms.Bf16CommCodec(name="rs/forward", counters=counters)
    x = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    enc = codec.encode(x)
    assert enc.dtype == torch.bfloat16 and enc.shape == x.shape  # the reduce-scatter needs the shape
    assert torch.isnan(codec.decode(enc)[0, 1])
    assert counters.as_dict() == {"rs/forward/sent": 1, "rs/forward/received": 1}


# --- configuration, registry, sharders -------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(forward="int8"), ValueError, "CommsConfig.forward"),
        (dict(backward="fp16"), ValueError, "CommsConfig.backward"),
        (dict(forward_format="e3m4"), ValueError, "CommsConfig.forward_format"),
        (dict(scale_format="ue8m0"), ValueError, "CommsConfig.scale_format"),
        (dict(block_size=-1), ValueError, "CommsConfig.block_size"),
        (dict(block_size=2.0), TypeError, "CommsConfig.block_size"),
        (dict(kernel="cuda"), ValueError, "CommsConfig.kernel"),
        (dict(forward=8), TypeError, "CommsConfig.forward"),
    ],
)
def test_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        CommsConfig(**kwargs)


def test_config_normalizes_case():
    assert CommsConfig(forward="FP8", backward_format="E4M3").forward == "fp8"


def test_registry_is_none_when_nothing_is_compressed():
    assert comms.registry(CommsConfig(forward="fp32", backward="fp32")) is None


def test_registry_covers_the_three_comm_ops(caplog):
    import importlib

    importlib.import_module("loka_torchrec.comms.registry")._warned.clear()  # the step-down warning is logged once per process
    counters = NonFiniteCounters()
    with caplog.at_level(logging.WARNING, logger="loka_torchrec.comms.registry"):
        reg = comms.registry(CommsConfig(forward="fp8", backward="fp8"), embedding_dims=[64, 128], counters=counters)
    assert set(reg) == {"POOLED_EMBEDDINGS_ALL_TO_ALL", "SEQUENCE_EMBEDDINGS_ALL_TO_ALL", "POOLED_EMBEDDINGS_REDUCE_SCATTER"}
    a2a = reg["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert isinstance(a2a.forward, Fp8CommCodec) and a2a.forward.fmt == Fp8Format.E4M3
    assert a2a.backward.fmt == Fp8Format.E5M2
    assert a2a.forward.block == 64 and a2a.forward.block_source == "row"  # gcd of the dims
    assert a2a.forward.counters is counters and a2a.backward.counters is counters
    rs = reg["POOLED_EMBEDDINGS_REDUCE_SCATTER"]
    assert isinstance(rs.forward, comms.Bf16CommCodec) and isinstance(rs.backward, comms.Bf16CommCodec)
    assert "uses bf16 instead of fp8" in caplog.text


def test_registry_mixed_precisions_and_blocks():
    reg = comms.registry(CommsConfig(forward="bf16", backward="fp8", backward_format="e4m3", block_size=32))
    a2a = reg["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"]
    assert isinstance(a2a.forward, comms.Bf16CommCodec)
    assert a2a.backward.fmt == Fp8Format.E4M3 and a2a.backward.block == 32
    reg = comms.registry(CommsConfig(forward="fp8", backward="fp32"))
    assert isinstance(reg["POOLED_EMBEDDINGS_ALL_TO_ALL"].backward, comms.Fp32CommCodec)
    assert reg["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward.block == comms.DEFAULT_BLOCK
    with pytest.raises(ValueError, match="does not divide the embedding dims \\[48\\]"):
        comms.registry(CommsConfig(forward="fp8", block_size=32), embedding_dims=[64, 48])


def test_sharders_bind_one_scale_per_row_of_each_module():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    ebc_sharder, ec_sharder = comms.sharders(CommsConfig(forward="fp8", backward="fp32"))
    assert isinstance(ebc_sharder, EmbeddingBagCollectionSharder)
    assert isinstance(ec_sharder, EmbeddingCollectionSharder)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{d}", embedding_dim=d, num_embeddings=4, feature_names=[f"f{d}"]) for d in (48, 96)],
        device=torch.device("meta"),
    )
    assert comms.module_embedding_dims(ebc) == [48, 96]
    assert comms.registry(CommsConfig(forward="fp8", backward="fp32"), embedding_dims=comms.module_embedding_dims(ebc))[
        "POOLED_EMBEDDINGS_ALL_TO_ALL"
    ].forward.block == 48
    # Outside shard() the planner sees the dims-agnostic registry.
    assert ebc_sharder.qcomm_codecs_registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward.block_source == "default"
    assert comms.sharders(CommsConfig(forward="fp32", backward="fp32"))[0].qcomm_codecs_registry in (None, {})


@pytest.mark.parametrize("round_trip", ["pickle", "deepcopy"])
def test_sharders_survive_pickle_and_deepcopy_with_working_codecs(round_trip):
    import copy
    import pickle

    originals = comms.sharders(CommsConfig(forward="fp8", backward="bf16"))
    block = comms.DEFAULT_BLOCK  # outside shard() the block is the default one
    originals[0].qcomm_codecs_registry["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward.encode(torch.full((block,), float("nan")))
    copies = pickle.loads(pickle.dumps(originals)) if round_trip == "pickle" else copy.deepcopy(originals)
    ebc_sharder, ec_sharder = copies
    assert ebc_sharder.nonfinite_counters is ec_sharder.nonfinite_counters  # still one shared counter
    assert ebc_sharder.nonfinite_counters is not originals[0].nonfinite_counters
    assert ebc_sharder.nonfinite_counters.as_dict()["pooled_embeddings_all_to_all/forward/sent"] == block  # counts so far
    codecs = ebc_sharder.qcomm_codecs_registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert codecs.forward.counters is ebc_sharder.nonfinite_counters
    x = torch.tensor([[0.5, -1.0, 2.0, float("inf")]] * block)
    decoded = codecs.forward.decode(codecs.forward.encode(x)).view_as(x)
    assert torch.equal(decoded[:, :3], x[:, :3])  # exact in E4M3
    assert not torch.isfinite(decoded[:, 3]).any()
    counts = ebc_sharder.nonfinite_counters.as_dict()
    assert counts["pooled_embeddings_all_to_all/forward/sent"] == 2 * block
    assert counts["pooled_embeddings_all_to_all/forward/received"] == block
    assert originals[0].nonfinite_counters.as_dict()["pooled_embeddings_all_to_all/forward/sent"] == block
    ebc_sharder.nonfinite_counters.reset()  # the copy's lock works
    assert ebc_sharder.nonfinite_counters.total() == 0


def test_fp8_codec_carries_a_float_payload_on_torchrecs_sync_path_only_while_grads_are_needed():
    from torchrec.distributed.comm_ops import get_use_sync_collectives, set_use_sync_collectives

    codec = comms.registry(CommsConfig(forward="fp8", backward="fp32"), embedding_dims=[4])["POOLED_EMBEDDINGS_ALL_TO_ALL"].forward
    x = torch.randn(3, 4, requires_grad=True)
    assert codec.encode(x, codec.create_context()).dtype == torch.uint8  # async path: FP8 bytes
    previous = get_use_sync_collectives()
    set_use_sync_collectives(True)
    try:
        with torch.no_grad():
            assert codec.encode(x, codec.create_context()).dtype == torch.uint8
        ctx = codec.create_context()
        payload = codec.encode(x, ctx)
        out = codec.decode(payload, ctx)
    finally:
        set_use_sync_collectives(previous)
    assert payload.dtype == torch.float32  # at least the configured backward precision
    assert codec.calc_quantized_size(12, ctx) == 12
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="sync_carrier: expected torch.bfloat16 or torch.float32"):
        Fp8CommCodec("e4m3", block=4, sync_carrier=torch.float16)
