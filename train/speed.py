"""Step speed-ups shared by ``train/distill.py`` and ``benchmarks/train/bench_train.py`` (issue 15).

Regional ``torch.compile`` of decoder layers (:class:`Forwards`) and the switch of a torch AdamW to its
fused kernel (:func:`set_fused_adam`). Neither changes the math: compiled layers and the fused AdamW
agree with eager and foreach within rounding. The fused-CE chunk math is ``train.loss`` (``ce_impl``).
"""

from __future__ import annotations

import contextlib
import math

import torch


class Forwards:
    """Eager and compiled ``forward`` of each module in a list, switchable at run time (regional compile).

    Compiled: ``torch.compile(forward, dynamic=False)`` per module, made at the first :meth:`use`. Modules of
    one class share the compiled code (one graph for all layers of a stack), which is compiled again for
    each new input shape and grad mode (see :func:`allow_recompiles`). Module hooks stay outside."""

    def __init__(self, modules):
        self.modules = list(modules)
        self.eager = [m.forward for m in self.modules]
        self.compiled = None
        self.active = False

    def use(self, compiled: bool) -> Forwards:
        if compiled and self.compiled is None:
            self.compiled = [torch.compile(f, dynamic=False) for f in self.eager]
        for m, e, c in zip(self.modules, self.eager, self.compiled or self.eager):
            m.forward = c if compiled else e
        self.active = compiled
        return self


@contextlib.contextmanager
def eager_forwards(forwards):
    """Every :class:`Forwards` in ``forwards`` eager inside the block (e.g. a decode whose lengths grow every
    step: one compile each), then as before."""
    was = [fw.active for fw in forwards]
    for fw in forwards:
        fw.use(False)
    try:
        yield
    finally:
        for fw, active in zip(forwards, was):
            fw.use(active)


def allow_recompiles(shapes: int) -> int:
    """Raise dynamo's per-code recompile limit to at least ``2·shapes + 2`` (each padded length, with and
    without grad, plus slack), at most 64; returns the limit in force."""
    import torch._dynamo as dynamo

    name = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
    limit = max(getattr(dynamo.config, name), min(64, 2 * shapes + 2))
    setattr(dynamo.config, name, limit)
    return limit


def length_buckets(max_length: int, pad_to_multiple: int) -> int:
    """Distinct padded sequence lengths a run can see (one compiled graph each)."""
    return math.ceil(max_length / max(pad_to_multiple, 1))


def compile_layers(target, draft, which: str, shapes: int = 1) -> list[Forwards]:
    """Regional compile of the frozen target's decoder layers and/or the draft's layers.

    ``which``: none | target | draft | both; ``target`` a :class:`dspine.target.TargetAdapter`, ``draft`` the
    unwrapped :class:`dspine.model.DSpineDraftModel` (``accelerator.unwrap_model``). ``shapes``: padded
    lengths expected (:func:`length_buckets`), for :func:`allow_recompiles`. Returns the active switches."""
    from dspine.target import decoder_layers

    if which not in ("none", "target", "draft", "both"):
        raise ValueError(f"compile_layers={which!r}: choose none, target, draft or both")
    stacks = []
    if which in ("target", "both"):
        stacks.append(decoder_layers(target.model))
    if which in ("draft", "both"):
        stacks.append(draft.layers)
    if stacks:
        allow_recompiles(shapes)
    return [Forwards(layers).use(True) for layers in stacks]


def torch_optimizer(opt):
    """The ``torch.optim`` optimizer inside accelerate's (and DeepSpeed's) wrappers."""
    while hasattr(opt, "optimizer") and opt.optimizer is not opt:
        opt = opt.optimizer
    return opt


def set_fused_adam(opt, fused: bool) -> None:
    """Switch a torch AdamW between its fused kernel and the default (foreach / for-loop) path, moving the
    ``step`` state where each path keeps it (the parameter's device for fused, CPU otherwise).

    Reaches the inner optimizer through accelerate's and DeepSpeed's (ZeRO-2/3) wrappers. Idempotent: called
    again after a checkpoint load it puts a restored ``step`` back where the chosen path expects it. The state
    is walked by its own keys, not through ``param_groups``: ZeRO-3 empties a group's ``params`` outside its
    step (it puts the group's fp32 partition there only while stepping), so a state reached through the
    groups would keep a CPU ``step`` that the fused kernel refuses."""
    inner = torch_optimizer(opt)
    for group in inner.param_groups:
        group["fused"] = fused or None
        if fused:
            group["foreach"] = None
    for p, st in inner.state.items():
        if isinstance(st, dict) and "step" in st and isinstance(p, torch.Tensor):
            st["step"] = st["step"].to(p.device if fused else "cpu")
