"""What the zoo's model configs share: field checks and ``from_options`` (a preset plus overrides).

Each model's config is a frozen dataclass with ``small``/``large``/``xl`` presets; the recipes give
its fields as a plain mapping. Errors name the config class and field, as the recipes' users
(``model.<field>=...``) read them once :func:`loka_job.models._model_error` renames the class.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Tuple, Type, TypeVar

__all__ = ["positive_int", "int_tuple", "config_from_options", "pooled_token_tables", "candidate_and_history", "sequence_collection"]

C = TypeVar("C")


def positive_int(value: Any, field: str, owner: str) -> None:
    """Refuse anything but an ``int >= 1`` (``bool`` included) for ``owner.field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{field} must be an int >= 1, got {value!r}")


def int_tuple(value: Any, field: str, owner: str) -> Tuple[int, ...]:
    """A sequence of ``int >= 1`` as a tuple, for ``owner.field``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{owner}.{field} must be a sequence of ints, got {type(value).__name__}")
    values = tuple(value)
    for i, v in enumerate(values):
        positive_int(v, f"{field}[{i}]", owner)
    return values


def config_from_options(cls: Type[C], options: Optional[Mapping[str, Any]], model: str) -> C:
    """``cls``'s ``preset`` (``"small"``/``"large"``/``"xl"``, default small) with the other keys of
    ``options`` as overrides; an unknown preset or key is one error naming it (``model`` says whose)."""
    values = dict(options or {})
    preset = values.pop("preset", "small")
    presets = {"small": cls.small, "large": cls.large, "xl": cls.xl}
    if preset not in presets:
        raise ValueError(f"model.preset must be one of {sorted(presets)}, got {preset!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"model: unknown {model} option(s) {unknown}; expected some of {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}
    return dataclasses.replace(presets[preset](), **values)


def pooled_token_tables(spec, embedding_dim: int, owner: str, model: str, embedding_device):
    """The ``EmbeddingBagCollection`` of a model that stacks every pooled feature as one token of
    width ``embedding_dim`` (DHEN, Wukong); errors name the data field that must change.

    Args:
        spec: the :class:`~loka_job.training.data_spec.DataSpec`; its pooled tables are used.
        embedding_dim: the tokens' width, which every table must have.
        owner, model: the config class and the model's name, for the errors.
        embedding_device: for the tables; ``None``: ``meta`` (``DistributedModelParallel``
            materializes them).
    """
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = spec.pooled_tables
    if not tables:
        raise ValueError(f"data: the {model} model needs pooled (non-sequence) sparse features; the DataSpec has none")
    for t in tables:
        if t.embedding_dim != embedding_dim:
            raise ValueError(
                f"data.embedding_dim: table {t.name!r} is {t.embedding_dim} wide but {owner}.embedding_dim "
                f"is {embedding_dim}; {model} stacks the features as tokens, so they must match"
            )
    configs = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=[t.feature])
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta") if embedding_device is None else embedding_device)


def candidate_and_history(spec, candidate_feature: str, owner: str):
    """``(sequence tables, history tables)`` of a model that reads one candidate sequence feature and
    the other sequence features as its history (HSTU, Interformer); the candidate must be one of them.

    Args:
        spec: the :class:`~loka_job.training.data_spec.DataSpec`.
        candidate_feature: the candidate's feature name.
        owner: the config class, for the error.
    """
    tables = spec.sequence_tables
    features = [t.feature for t in tables]
    if candidate_feature not in features:
        raise ValueError(
            f"{owner}.candidate_feature: {candidate_feature!r} is not a sequence feature of the data "
            f"(sequence features: {features})"
        )
    return tables, [t for t in tables if t.feature != candidate_feature]


def sequence_collection(tables, embedding_dim: int, owner: str, embedding_device):
    """The ``EmbeddingCollection`` of sequence ``tables`` that all are ``embedding_dim`` wide; features
    naming one table share it (they must agree on its rows).

    Args:
        tables: the sequence :class:`~loka_job.training.data_spec.TableSpec` s.
        embedding_dim: the width every table must have.
        owner: the config class, for the errors.
        embedding_device: for the tables; ``None``: ``meta`` (``DistributedModelParallel`` materializes them).
    """
    import torch
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    for t in tables:
        if t.embedding_dim != embedding_dim:
            raise ValueError(
                f"data.embedding_dim: table {t.name!r} (feature {t.feature!r}) is {t.embedding_dim} wide but "
                f"{owner}.embedding_dim is {embedding_dim}"
            )
    groups = {}
    for t in tables:
        groups.setdefault(t.name, []).append(t)
    for name, group in groups.items():
        rows = {t.num_embeddings for t in group}
        if len(rows) != 1:
            raise ValueError(
                f"data: features {[t.feature for t in group]} share table {name!r} but disagree on its rows "
                f"{sorted(rows)}"
            )
    configs = [
        EmbeddingConfig(name=name, embedding_dim=embedding_dim, num_embeddings=group[0].num_embeddings,
                        feature_names=[t.feature for t in group])  # fmt: skip
        for name, group in groups.items()
    ]
    return EmbeddingCollection(tables=configs, device=torch.device("meta") if embedding_device is None else embedding_device)
