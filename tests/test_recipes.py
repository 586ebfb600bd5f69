"""The Hydra recipes compose, build their model (on ``meta``: no CPU training of the large ones),
and bad model options fail with one error that names the field. Fast: no processes, no data."""

import dataclasses
import os

import pytest
import torch
from torch import nn

from loka_torchrec.config import from_mapping
from loka_job.models import MODEL_NAMES, build_model

RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "model")
RECIPES = sorted(f[: -len(".yaml")] for f in os.listdir(RECIPE_DIR) if f.endswith(".yaml"))
META = torch.device("meta")


def compose(*overrides):
    """The resolved recipe as a plain dict, exactly as ``python -m loka_job.train`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module("loka_job.recipes", version_base=None):
        cfg = hydra_compose("config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def data_spec(data):
    """The recipe's DataSpec without generating any data (the teacher of a large preset is costly)."""
    options = dict(data)
    kind = options.pop("kind")
    if kind == "pooled":
        from loka_job.training.synthetic import SyntheticConfig, make_data_spec

        return make_data_spec(from_mapping(SyntheticConfig, options, field="data"))
    from loka_job.training.synthetic_sequences import SyntheticSequenceConfig, make_sequence_data_spec

    return make_sequence_data_spec(from_mapping(SyntheticSequenceConfig, options, field="data"))


def build(cfg, device=META):
    model = dict(cfg["model"])
    return build_model(model.pop("name"), model, data_spec(cfg["data"]), device)


def _model_name(recipe):
    return recipe.split("_")[0]  # dhen_xl -> dhen


def test_every_model_has_a_small_and_a_large_recipe():
    assert set(RECIPES) == {
        "dlrm", "dcn", "dhen", "hstu", "wukong", "interformer", "dcnv2", "dlrm_large", "dcn_large", "dhen_large",
        "hstu_large", "wukong_large", "interformer_large", "dcnv2_large", "dhen_xl", "hstu_xl", "wukong_xl",
        "interformer_xl", "dcnv2_xl",
    }  # fmt: skip
    assert set(MODEL_NAMES()) == {"dlrm", "dcn", "dhen", "hstu", "wukong", "interformer", "dcnv2"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_builds_its_model(recipe):
    cfg = compose(f"model={recipe}")
    assert cfg["model"]["name"] == _model_name(recipe)
    assert cfg["data"]["kind"] == ("sequence" if recipe.startswith(("hstu", "interformer")) else "pooled")
    assert isinstance(cfg["data"]["embedding_dim"], int) and isinstance(cfg["data"]["batch_size"], int)
    model = build(cfg)
    assert isinstance(model, nn.Module)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_the_command_line_wins_over_a_recipe():
    cfg = compose("model=hstu_large", "data.max_seq_len=64", "model.num_layers=2", "train.lr=0.02")
    assert cfg["data"]["max_seq_len"] == 64 and cfg["model"]["num_layers"] == 2 and cfg["train"]["lr"] == 0.02
    assert build(cfg).max_len == 64
    # model.embedding_dim follows data.embedding_dim (an interpolation in the recipe)
    cfg = compose("model=dhen", "data.embedding_dim=16")
    assert cfg["model"]["embedding_dim"] == 16
    assert build(cfg).config.embedding_dim == 16


def _config_class(recipe):
    from loka_job.models.dcn_v2 import DcnV2Config
    from loka_job.models.dhen import DhenConfig
    from loka_job.models.hstu import HstuConfig
    from loka_job.models.interformer import InterformerConfig

    return {"dhen": DhenConfig, "hstu": HstuConfig, "interformer": InterformerConfig, "dcnv2": DcnV2Config}[_model_name(recipe)]


@pytest.mark.parametrize(
    "recipe, preset",
    [("dhen", "small"), ("dhen_large", "large"), ("dhen_xl", "xl"), ("hstu", "small"), ("hstu_large", "large"),
     ("hstu_xl", "xl"), ("interformer", "small"), ("interformer_large", "large"), ("interformer_xl", "xl"),
     ("dcnv2", "small"), ("dcnv2_large", "large"), ("dcnv2_xl", "xl")],
)
def test_recipes_are_the_config_presets(recipe, preset):
    """The yaml files spell out every field (so `model.x=...` needs no `+`); they must not drift."""
    cls = _config_class(recipe)
    options = dict(compose(f"model={recipe}")["model"])
    options.pop("name")
    assert set(options) == {f.name for f in dataclasses.fields(cls)}
    assert cls.from_options(options) == getattr(cls, preset)()


def _gemm_shapes(model):
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("recipe", ["dlrm_large", "dcn_large", "dhen_large", "hstu_large"])
def test_large_presets_have_lrm_sized_gemms(recipe):
    """Most dense weights sit in GEMMs with K, N in 256..2048; M (rows per GEMM) is in 2k..64k."""
    cfg = compose(f"model={recipe}")
    model = build(cfg)
    shapes = _gemm_shapes(model)
    total = sum(k * n for k, n in shapes)
    lrm = sum(k * n for k, n in shapes if 256 <= k <= 2048 and 256 <= n <= 2048)
    assert lrm >= 0.9 * total, shapes
    data = cfg["data"]
    if data["kind"] == "sequence":
        rows = data["batch_size"] * (data["min_seq_len"] + data["max_seq_len"]) / 2  # expected history tokens
    else:
        rows = data["batch_size"]
    assert 2048 <= rows <= 65536


def test_large_dhen_has_the_documented_shape():
    model = build(compose("model=dhen_large"))
    assert model.over_arch.num_tokens == 8  # 7 pooled features + the dense token
    assert model.config.embedding_dim == 256
    assert (2048, 512) in _gemm_shapes(model)  # a layer's fused entry (cross V + linear map)


def test_wukong_recipes_are_the_config_presets_and_xl_has_the_documented_shape():
    from loka_job.models.wukong import WukongConfig

    for recipe, preset in (("wukong", "small"), ("wukong_large", "large"), ("wukong_xl", "xl")):
        options = dict(compose(f"model={recipe}")["model"])
        options.pop("name")
        assert WukongConfig.from_options(options) == getattr(WukongConfig, preset)()
    cfg = compose("model=wukong_xl")
    model = build(cfg)
    shapes = _gemm_shapes(model)
    assert cfg["data"]["batch_size"] == 8192 and model.over_arch.layers[0].fmb.projection.shape == (64, 24)
    assert shapes.count((4096, 4096)) == 6 * 2 + 1 and (1536, 4096) in shapes and (8192, 4096) in shapes
    # the GEMMs are in nn.Linear layers and in raw Parameters (the FMB projection, the LCB)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 6 * 3 + 3 + 2


def test_interformer_and_dcnv2_gpu_recipes_have_the_documented_shape():
    """interformer_large: 32 non-sequence tokens (8192 wide) beside a 16-token sequence summary, the
    GEMMs its recipe lists, at batch 8192 with histories of up to 64 items (interformer_xl: the same
    model, histories of up to 256 at batch 2048); dcnv2_xl: an 8192-wide x_0 under three full-rank
    cross layers and the deep network, at batch 8192."""
    from torchrec.modules.crossnet import CrossNet, LowRankCrossNet

    cfg = compose("model=interformer_large")
    model = build(cfg)
    arch, data = model.over_arch, cfg["data"]
    assert arch.num_tokens == 32 and model.max_len == data["max_seq_len"] == 64 and data["batch_size"] == 8192
    shapes = _gemm_shapes(model)
    for shape in ((8192, 512), (4096, 4096), (13416, 2048), (2048, 8192), (512, 65536), (12288, 2048)):
        assert shape in shapes, shape
    cross = arch.layers[0].interaction.cross
    assert isinstance(cross, LowRankCrossNet) and cross.V_kernels[0].shape == (512, 12288)
    assert arch.layers[0].sequence.attention.in_proj_weight.shape == (768, 256)
    xl = compose("model=interformer_xl")
    assert xl["model"] == cfg["model"] and (xl["data"]["max_seq_len"], xl["data"]["batch_size"]) == (256, 2048)

    cfg = compose("model=dcnv2_xl")
    model = build(cfg)
    assert model.over_arch.width == 8192 and cfg["data"]["batch_size"] == 8192
    assert isinstance(model.over_arch.cross, CrossNet)
    assert [tuple(k.shape) for k in model.over_arch.cross.kernels] == [(8192, 8192)] * 3
    assert {(8192, 4096), (4096, 4096), (4096, 1)} <= set(_gemm_shapes(model))
    assert build(compose("model=dcnv2_large")).over_arch.width == 4096


def test_xl_recipes_have_the_documented_shape():
    """dhen_xl: a 16384-wide stack (63 features x 256 + the dense token) at batch 8192; hstu_xl:
    D = 1024 over histories of up to 512 items, 64k..128k expected tokens per GPU."""
    cfg = compose("model=dhen_xl")
    model = build(cfg)
    assert model.over_arch.num_tokens == 64 and cfg["data"]["batch_size"] == 8192
    shapes = _gemm_shapes(model)
    assert (16384, 4096) in shapes and (1024, 16384) in shapes and (16384, 1024) in shapes
    wide = sum(k * n for k, n in shapes if max(k, n) >= 4096)
    assert wide >= 0.9 * sum(k * n for k, n in shapes)  # the step is the wide GEMMs
    cfg = compose("model=hstu_xl")
    model = build(cfg)
    data = cfg["data"]
    assert model.config.embedding_dim == 1024 and model.max_len == data["max_seq_len"] == 512
    assert 65536 <= data["batch_size"] * (data["min_seq_len"] + data["max_seq_len"]) / 2 <= 131072


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=hstu", "data=pooled"], "model.name: the hstu model needs sequence data (data.kind=sequence"),
        (["model=dhen", "data=sequence"], "model.name: the dhen model needs pooled sparse features"),
        (["model=dhen", "model.embedding_dim=64"], "model.embedding_dim: 64 disagrees with data.embedding_dim (32)"),
        (["model=hstu", "model.embedding_dim=16"], "model.embedding_dim: 16 disagrees with data.embedding_dim (32)"),
        (["model=dhen", "model.attention_heads=3"], "model.attention_heads (3) must divide embedding_dim (32)"),
        (["model=dhen", "model.ensemble=stack"], "model.ensemble must be one of"),
        (["model=dhen", "model.interactions=[dot,nope]"], "model.interactions must be distinct names"),
        (["model=dhen", "model.head_hidden=7"], "model.head_hidden must be a sequence of ints"),
        (["model=dhen", "+model.bogus=1"], "model: unknown DHEN option(s) ['bogus']"),
        (["model=hstu", "model.num_heads=0"], "model.num_heads must be an int >= 1"),
        (["model=hstu", "model.candidate_feature=nope"], "model.candidate_feature: 'nope' is not a sequence feature"),
        (["model=dhen", "data.num_tables=2"], "model.ensemble='concat' needs at least one output token per"),
        (["model=interformer", "data=pooled"], "data: unknown option(s) ['num_context_features']"),  # the recipe adds context to sequence data
        (["model=interformer", "model.num_heads=3"], "model.num_heads (3) must divide embedding_dim (16)"),
        (["model=interformer", "model.recent_tokens=30"], "model.recent_tokens (30) must be <= the longest history (data.max_seq_len = 20)"),
        (["model=interformer", "model.candidate_feature=nope"], "model.candidate_feature: 'nope' is not a sequence feature"),
        (["model=interformer", "+model.bogus=1"], "model: unknown Interformer option(s) ['bogus']"),
        (["model=dcnv2", "data=sequence"], "model.name: the dcnv2 model needs pooled sparse features"),
        (["model=dcnv2", "model.cross=diagonal"], "model.cross must be one of ('full', 'low_rank', 'mixture')"),
        (["model=dcnv2", "model.structure=tree"], "model.structure must be one of ('stacked', 'parallel')"),
        (["model=dcnv2", "model.embedding_dim=32"], "model.embedding_dim: 32 disagrees with data.embedding_dim (16)"),
    ],
)
def test_bad_model_options_are_one_clear_error(overrides, message):
    with pytest.raises(ValueError) as info:
        build(compose(*overrides))
    assert message in str(info.value)


def test_switching_only_data_kind_says_how_to_switch():
    from loka_job.training.data import make_data

    data = compose("model=dlrm", "data.kind=sequence")["data"]
    with pytest.raises(ValueError, match=r"data: unknown option\(s\) \['num_embeddings'.*`data=sequence`"):
        make_data(data, rank=0, world_size=1, seed=0)
