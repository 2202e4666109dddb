"""Test helpers: untrained drafts and "oracle" drafts that propose the true continuation."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dspine.config import DSpineConfig
from dspine.model import DSpineDraftModel


def random_draft(target, block_size=8, layers=2, injection="residual", mask=None, seed=0, layer_types=None,
                 sliding_window=None, **dspine):
    """An untrained draft sized for ``target`` (a TargetAdapter) with non-zero injection gates; ``layer_types`` and
    ``sliding_window`` as DSpineConfig's (default: every layer full attention)."""
    cfg = target.config
    torch.manual_seed(seed)
    dcfg = DSpineConfig(
        vocab_size=target.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=getattr(cfg, "head_dim", None),
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"],
        block_size=block_size, num_target_layers=target.num_layers,
        dflash_config={"mask_token_id": mask, "target_layer_ids": [1, target.num_layers - 2]},
        dspine_config={"injection": injection, **dspine},
        **({"layer_types": layer_types, "sliding_window": sliding_window} if layer_types else {}),
    )
    draft = DSpineDraftModel(dcfg).eval()
    if injection == "residual":
        for layer in draft.layers:
            if layer.adjacent is not None:
                torch.nn.init.normal_(layer.adjacent.gate, std=0.5)
    return draft


def oracle_logits(reference_of, lengths, B, K, V, corrupt, gen):
    """One-hot logits ``[B, K, V]``: slot k of row b proposes ``reference_of(b)[lengths[b] + k]``,
    replaced by a random token with probability ``corrupt``."""
    logits = torch.zeros(B, K, V)
    for b in range(B):
        seq = reference_of(b)
        start = int(lengths[b])
        for k in range(1, K + 1):
            tok = seq[start + k] if seq is not None and start + k < len(seq) else 0
            if torch.rand(1, generator=gen).item() < corrupt:
                tok = int(torch.randint(0, V, (1,), generator=gen))
            logits[b, k - 1, tok] = 10.0
    return logits


def oracle_reference_decoder(decoder, reference: list[list[int]], corrupt: float, seed: int = 0):
    """Patch a ReferenceDecoder so its draft proposes the true greedy continuation (corrupted)."""
    g = torch.Generator().manual_seed(seed)
    V = decoder.target.vocab_size

    def draft_logits(block, dcache):
        B, bs = block.shape
        return oracle_logits(lambda b: reference[b], dcache.lengths, B, bs - 1, V, corrupt, g)[:, : decoder.verify_size - 1]

    decoder.draft_logits = draft_logits
    return decoder


def oracle_engine(engine, reference: list[list[int]], corrupt: float, seed: int = 0):
    """Patch an Engine's draft the same way (eager engines only; uses the slot -> prompt map)."""
    g = torch.Generator().manual_seed(seed)
    V = engine.target.args.vocab_size

    def draft_logits(block, cache, width=None):  # width: a planner chain narrower than verify_size
        B, bs = block.shape
        owner = engine.slot_owner or [None] * B  # None: the planner's start-up timing, before any admission
        ref = lambda b: reference[owner[b]] if owner[b] is not None else None
        logits = oracle_logits(ref, cache.lengths, B, bs - 1, V, corrupt, g)
        return logits[:, : (width or engine.verify_size) - 1].to(engine.device, engine.target.embed.dtype)

    engine.draft_logits = draft_logits
    return engine


# A tiny hybrid text model (3 gated delta-rule layers + 1 full-attention layer; transformers' default
# layer_types for 4 layers), shared by the hybrid target, hybrid engine and multimodal target tests.
HYBRID_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
                   initializer_range=0.1, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                   tie_word_embeddings=False)


def hybrid_config(kind: str, num_experts: int = 2, num_experts_per_tok: int = 1):
    """``qwen3_5`` (a Qwen3_5TextConfig) or ``qwen3_next`` (a Qwen3NextConfig with ``num_experts`` MoE
    experts, ``num_experts_per_tok`` routed per token) over :data:`HYBRID_TEXT`."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    if kind == "qwen3_next":
        return Qwen3NextConfig(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, **HYBRID_TEXT)
    return Qwen3_5TextConfig(**HYBRID_TEXT)


def call_without_fla(fn: str, *args):
    """``fn(*args)`` (``fn`` = "module:function", importable from the repository root) with fla-core out of
    transformers' reach, and its result.

    When fla-core is installed, transformers binds its gated delta rule (Qwen3.5 / Qwen3-Next prefill and
    decode) to fla's Triton kernels at import: they cannot run on CPU tensors, use TF32 products for fp32
    inputs unless TRITON_F32_DEFAULT=ieee, and autotune on first use. A reference must be transformers' own
    torch code, so the call then runs in a child Python process in which ``import fla`` fails (args and
    result travel through ``torch.save``; the child's stderr is the caller's). Without fla-core it runs in
    this process. Raises CalledProcessError when the child fails."""
    module, name = fn.split(":")
    if importlib.util.find_spec("fla") is None:
        return getattr(importlib.import_module(module), name)(*args)
    root = str(Path(__file__).resolve().parents[1])
    code = ("import importlib, sys, torch; sys.modules['fla'] = None; sys.path.insert(0, sys.argv[1]); "
            "m, f = sys.argv[2].split(':'); "
            "torch.save(getattr(importlib.import_module(m), f)(*torch.load(sys.argv[3])), sys.argv[4])")
    with tempfile.TemporaryDirectory(prefix="dspine-nofla-") as tmp:
        inp, out = Path(tmp, "args.pt"), Path(tmp, "out.pt")
        torch.save(args, inp)
        subprocess.run([sys.executable, "-c", code, root, fn, str(inp), str(out)], check=True)
        return torch.load(out)


_DISTILL_CASES = r"""
import contextlib, io, json, os, sys, traceback
sys.path.insert(0, sys.argv[1])
from train.distill import main

results = []
cases, read_after = json.load(open(sys.argv[2]))
for argv in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:  # what the interpreter would print for an uncaught exception, and its status
            traceback.print_exc()
            rc = 1
    files = {p: open(p).read() if os.path.isfile(p) else None for p in read_after}
    results.append({"returncode": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "files": files})
json.dump(results, open(sys.argv[3], "w"))
"""


def distill_cases(cases: list[list[str]], read_after=(), timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """``python train/distill.py ARGV`` for each ARGV of ``cases``, one after the other in ONE child process
    (``train.distill.main(ARGV)`` per case, its stdout/stderr captured, an uncaught exception printed as the
    interpreter would, with exit status 1): one torch/transformers import for all of them instead of one per
    case. For runs that stop before or after training on their own; each case's result as from subprocess.run,
    with ``.files``: the text of each file of ``read_after`` right after that case (None: not a file)."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="dspine-distill-") as tmp:
        inp, out = Path(tmp, "cases.json"), Path(tmp, "results.json")
        inp.write_text(json.dumps([[[str(a) for a in argv] for argv in cases], [str(p) for p in read_after]]))
        subprocess.run([sys.executable, "-c", _DISTILL_CASES, str(root), str(inp), str(out)], check=True, cwd=root,
                       timeout=timeout)
        runs = []
        for argv, r in zip(cases, json.loads(out.read_text()), strict=True):
            runs.append(subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"]))
            runs[-1].files = r["files"]
        return runs
