"""Which layers the Probe watches, and the hooks that fold their rows into a probe step's statistics.

Hooks are registered only for probe steps: a forward hook on every layer folds the layer's input
rows into this step's statistics and registers a tensor hook on the output that folds the output
gradient rows in during the backward pass. Other steps run without any hook (no cost at all).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from loka_torchrec.evidence import EvidenceConsumer
from loka_torchrec.probe.layer_state import LayerState

__all__ = ["ProbeHooks", "canonical_fqn", "resolve_layers"]

logger = logging.getLogger("loka_torchrec.probe")

_WRAPPER_PREFIXES = ("_dmp_wrapped_module.", "module.", "_orig_mod.")


def canonical_fqn(name: str) -> str:
    """A module's FQN without the wrapper prefixes of DMP (``_dmp_wrapped_module.``), DDP
    (``module.``) and ``torch.compile`` (``_orig_mod.``).

    Example::

        >>> canonical_fqn("_dmp_wrapped_module.module.over.layers.0")
        'over.layers.0'
    """
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def resolve_layers(
    model: nn.Module, consumer: Optional[EvidenceConsumer], layers: Optional[Mapping[str, nn.Module]]
) -> Dict[str, nn.Module]:
    """``{fqn: module}`` to probe: the consumer's managed layers, else ``layers``, else every
    ``nn.Linear`` of ``model`` (FQNs without wrapper prefixes).

    Raises:
        TypeError: ``layers`` is not a mapping, or a key is not a str.
    """
    if consumer is not None:
        found = dict(consumer.managed_layers())
    elif layers is not None:
        if not isinstance(layers, Mapping):
            raise TypeError(f"layers: expected a mapping of FQN to module, got {type(layers).__name__}")
        found = dict(layers)
    else:
        found = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                found.setdefault(canonical_fqn(name), module)
    for name in found:
        if not isinstance(name, str):
            raise TypeError(f"layers: expected str FQNs as keys, got {name!r}")
    return found


class ProbeHooks:
    """The forward hooks on every watched layer, registered for probe steps only.

    Args:
        layers: the Probe's layer states, by FQN (each hook folds into its layer's windows).
        consumer: Dispatch, whose current modules are hooked (it may have swapped a module since
            the last probe step), or ``None``.
        seconds: the Probe's time account; the hooks add their host seconds to ``"hooks"``.
    """

    def __init__(self, layers: Dict[str, LayerState], consumer: Optional[EvidenceConsumer], seconds: Dict[str, float]) -> None:
        self._layers = layers
        self._consumer = consumer
        self._seconds = seconds
        self._handles: List[Any] = []
        self._paused = False  # paused(): passes that are not training steps
        self.armed = False

    def arm(self) -> None:
        """Register a forward hook on every layer (nothing if already armed)."""
        if self.armed:
            return
        if self._consumer is not None:
            # Dispatch may have swapped modules (e.g. nn.Linear -> LokaLinear) since the last probe step.
            current = dict(self._consumer.managed_layers())
            for name, state in self._layers.items():
                if current.get(name) is not None:
                    state.module = current[name]
        for state in self._layers.values():
            hook = functools.partial(self._forward_hook, state)
            self._handles.append(state.module.register_forward_hook(hook, with_kwargs=True))
        self.armed = True

    def disarm(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.armed = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside this block the hooks record nothing."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def _forward_hook(self, state: LayerState, module: nn.Module, args: Tuple, kwargs: Dict[str, Any], output: Any) -> None:
        if not module.training or self._paused:
            return  # evaluation passes inside a probe step, and paused passes, are not training data
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not torch.is_tensor(x) or not x.is_floating_point():
            return
        t0 = time.perf_counter()
        moments = state.collect_moments
        token = None
        try:
            with torch.no_grad():
                state.window_act.update(x, delayed_amax=state.delayed_amax("act"), moments=moments)
                if moments:
                    token = state.reservoir.offer_inputs(x)
        except ValueError as exc:
            if not state.warned:
                logger.warning("Probe: skipping layer %s: %s", state.name, exc)
                state.warned = True
            return
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(functools.partial(self._grad_hook, state, token))
        self._seconds["hooks"] += time.perf_counter() - t0

    def _grad_hook(self, state: LayerState, token: Any, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            state.window_grad.update(grad, delayed_amax=state.delayed_amax("grad"), moments=token is not None)
            if token is not None:
                state.reservoir.offer_grads(token, grad)
        self._seconds["hooks"] += time.perf_counter() - t0
