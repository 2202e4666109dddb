"""The CUDA inference engine: static caches, one graph-captured step, ragged batches with refill.

Per step (docs/method.md §5), for all B batch slots at once and with no host synchronisation inside:
draft block -> draft tokens (argmax, or a sample from p_d kept for verification) -> target
verify over the static KV cache (features captured) -> acceptance (``dspine.ops.accept``: exact
match, or chain rejection sampling) -> commit (EOS / max_new_tokens cut, histogram) -> draft context
append, which advances ``lengths`` by a + 1. The target cache keeps every verified position, but
only ``lengths`` of them count: rejected slots are simply overwritten by the next step. The host
looks at the ``done`` flags once per step, harvests finished rows and refills their slots from the
queue (one packed prefill for the prompts admitted together), so benchmarks run at a fixed concurrency.
It reads them one step late (issue 11; with the planner too since issue 16): step k is launched before
the flags from before it are read, so the host's work overlaps the device's, and a finished row idles one
step.

The draft is ``dspine.model.DSpineDraftModel`` itself (weights fused at load), the sampler and its
per-request random streams are ``dspine.sampling``'s (so a prompt's output does not depend on its
batch neighbours or the concurrency), the result is ``dspine.stats.GenerationResult``.

On a GPU the step is captured as a CUDA graph per (batch size, sampling settings); on the CPU the
same code runs eagerly with the PyTorch reference kernels, which is how the tests check it.

LM head (issue 12): before a step runner is built, each vocabulary GEMM it will run (the target's
logits over B·T rows, the draft's over B·(verify_size - 1)) gets its implementation from
``dspine.ops.lm_head.pick``, timed once per row count on this device and logged; the runner (and
its graph) then calls the chosen kernel. Only on a GPU with the Triton kernels and outside exact mode
(exact mode keeps its row-invariant GEMM); elsewhere ``F.linear``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspine import sampling as rng
from dspine.checkpoint import load_draft
from dspine.draft_vocab import check_tokens, head_rows, load_draft_vocab, spread_logits
from dspine.model import DraftCache, DSpineDraftModel
from dspine.ops._common import set_pdl_auto
from dspine.ops.accept import accept_greedy, accept_sample, commit_step
from dspine.ops.argmax_prob import argmax_prob
from dspine.ops.defer import defer_features
from dspine.ops.lm_head import lm_head as lm_head_op
from dspine.ops.lm_head import pick as pick_lm_head
from dspine.ops.plan_stats import plan_stats
from dspine.ops.tree_build import build_tree_fused
from dspine.ops.tree_verify import verify_tree_greedy, verify_tree_sample
from dspine.reference import check_prompts, request_seeds
from dspine.sampling import (
    SamplingParams,
    check_tree_draft_temperature,
    draft_distribution,
    logits_to_probs,
    nonfinite_error,
    sample,
)
from dspine.stats import AcceptStats, GenerationResult
from dspine.target import TargetSpec, assert_compatible, check_target_dtype
from dspine.tree import node_uniforms, path_nodes
from infer import model as infer_model
from infer.model import EXACT_DEFAULT, EngineTarget, KVCache
from infer.planner import (
    DRAIN_MODELS,
    StepPlanner,
    append_plan_record,
    plan_log_path,
)


@dataclass
class _DeferredPrompts:
    """One admission's prompts whose draft context waits (:meth:`Engine._admit` with ``defer``)."""

    features: torch.Tensor  # [ΣP, k·H] the prompts' target features, packed
    counts: torch.Tensor  # [n] int32 P of each prompt (device)
    rows: torch.Tensor  # [n] int64 their slots (device)
    keep: list[bool]  # per prompt: still its slot's request (False once the slot is refilled)
    slots: list[int]  # the slots, on the host


class _Slots:
    """Per-slot state of a batch of B slots: static device tensors that the step updates in place
    (a CUDA graph captures their addresses). A slot holds one request from admission to harvest.

    anchor        [B] int64   last committed token: slot 0 of the next block
    lengths       [B] int32   committed positions in the target KV cache and the draft context; the
                              anchor sits at position lengths[b]. Shared with the draft cache view,
                              whose append advances it by a + 1 per live row (planner: the draft context
                              holds lengths - pend_count of them, below)
    seeds         [B] int64   the request's seed (``dspine.sampling`` streams)
    out_tokens    [B, max_new] int64  generated tokens, prefill token first
    out_len       [B] int32   tokens in out_tokens; also the sampler's output position
    max_new       [B] int32   the request's max_new_tokens
    done          [B] int32   1 = finished or idle: the step computes the row but commits nothing
    hist          [B, verify_size + 1] int32  hist[b, n] = this request's steps that committed n tokens
    verify_block  [B, verify_size] int64  anchor + the K = verify_size - 1 draft tokens the target verifies
    draft_block   [B, block_size] int64  anchor + MASK x (block_size - 1): the draft's input
    nonfinite     [2] int32   target / draft logits were NaN or Inf since the flags were cleared (1)
    no_draft      [B] int32   zeros: "0 accepted" for the autoregressive commit
    offsets       [verify_size] int64  0 .. verify_size - 1 (static: no arange launch per step)
    conf          [B] fp32    planner only: the draft's confidence of the last speculative step, expected
                              committed tokens of its chain (``dspine.ops.plan_stats.chain_confidence``); stale after an AR step
    chain_acc     [B] int32   planner only: draft tokens the chain would have accepted in the last tree step
                              (the chain nodes on its accepted path, :meth:`Engine._tree_step`); stale after
                              any other step
    inner_acc     [S, B] int32  planner only: per planner tree smaller than the last tree step's (S = the planner's
                              tree sizes less one, ascending), the draft tokens it would have accepted there
                              (``dspine.tree.inner_accepted``); stale in the other columns and after any other step
    state         [(4 + S)B + 2] int32  one buffer of which ``done``, ``nonfinite``, ``out_len``, ``conf`` (its fp32
                              bits), ``chain_acc`` and ``inner_acc`` are views, in this order: what the decode loops read
                              after a step crosses the bus in one copy of a prefix of it (the flags:
                              ``state[:B + 2]``; the planner: all of it), no gather kernel per step

    Planner only (``pending = (F, k·H, dtype)``, ``F = Engine.ar_defer``): the deferred draft-context append of
    the AR steps (:meth:`Engine._ar_step`, :meth:`Engine._flush_step`); None (pend_max 0) otherwise.

    pend_max      int         F: most pending features per row (``Engine.ar_defer`` when the slots were made)
    pend_feats    [B·F + 1, k·H] model dtype  target features of the AR steps since the last flush: row b's
                              t-th at index b·F + t (a view ``[B, F, k·H]`` of the first B·F); the last index
                              is a scratch row (the torch path of ``defer_features`` writes idle rows there)
    pend_count    [B] int32   pending features per row: the draft context of row b holds
                              lengths[b] - pend_count[b] positions
    pend_lengths  [B] int32   the flush's draft-context lengths: lengths - pend_count, advanced to lengths
                              by the flush's append
    """

    def __init__(self, B: int, verify_size: int, block_size: int, max_new: int, device, mask_id: int,
                 pending: tuple[int, int, torch.dtype] | None = None, inner: int = 0):
        i32, i64 = torch.int32, torch.int64
        self.B, self.verify_size = B, verify_size
        self.anchor = torch.zeros(B, dtype=i64, device=device)
        self.lengths = torch.zeros(B, dtype=i32, device=device)
        self.seeds = torch.zeros(B, dtype=i64, device=device)
        self.out_tokens = torch.zeros(B, max_new, dtype=i64, device=device)
        # done, nonfinite, out_len, conf, chain_acc, inner_acc: views of one buffer (the class docstring's ``state``)
        self.state = torch.zeros((4 + inner) * B + 2, dtype=i32, device=device)
        self.done, self.nonfinite, self.out_len, conf, self.chain_acc, inner_acc = self.state.split(
            [B, 2, B, B, B, inner * B])
        self.inner_acc = inner_acc.view(inner, B)
        self.conf = conf.view(torch.float32)
        self.done.fill_(1)
        self.conf.fill_(1.0)
        self.max_new = torch.ones(B, dtype=i32, device=device)
        self.hist = torch.zeros(B, verify_size + 1, dtype=i32, device=device)
        self.verify_block = torch.zeros(B, verify_size, dtype=i64, device=device)
        self.draft_block = torch.full((B, block_size), mask_id, dtype=i64, device=device)
        self.no_draft = torch.zeros(B, dtype=i32, device=device)
        self.offsets = torch.arange(verify_size, dtype=i64, device=device)
        self.pend_max = 0
        self.pend_feats = self.pend_count = self.pend_lengths = None
        # the planner's deferred prompt contexts, one per admission (Engine._admit with defer, Engine._write_deferred)
        self.ctx_pending: list[_DeferredPrompts] = []
        if pending is not None:
            F_, width, dtype = pending
            self.pend_max = F_
            self.pend_feats = torch.zeros(B * F_ + 1, width, dtype=dtype, device=device)
            self.pend_count = torch.zeros(B, dtype=i32, device=device)
            self.pend_lengths = torch.zeros(B, dtype=i32, device=device)


class Engine:
    """Speculative (or autoregressive) generation over a batch of slots.

    Args:
        target: the engine's target model.
        draft: a DSpine/DFlash draft (moved to the target's device and dtype, weights fused), or None
            (autoregressive only). Its embedding and lm_head are the target's.
        eos_token_ids: tokens that end a sequence.
        max_batch: most concurrent sequences; max_seq: prompt + new tokens + block per sequence.
        cuda_graphs: capture the step as a CUDA graph (GPU only).
        verify_size: slots verified per step, anchor included (<= the draft's block size; default =
            block size); a step proposes K = verify_size - 1 draft tokens.
        force_accept: benchmark only — accept exactly this many draft tokens per step whatever the
            target says (the "oracle draft" of the engine benchmark); output is then not the target's. Refused with
            invariant sampling (``SamplingParams.invariant``), whose contract is the plain decode's text.
        verify: "chain" (verify_size slots) or "tree" (a token tree of ``tree_budget`` nodes,
            ``dspine.tree``: tree attention over the static cache, then the accepted path's K/V are
            moved into consecutive cache rows inside the step).
        tree_budget: nodes per tree, anchor included, 2..64 (``verify="tree"``).
        tree_chain_first: whether a tree keeps the draft's whole chain first (``dspine.tree.build_tree``'s
            ``chain_first``). None (default): at T = 0 every node by its path score alone, which spends the
            budget on siblings that outscore the chain's deep nodes (lossless: the output is the target's
            greedy output whatever the tree); at T > 0 chain first, which the tree's rejection sampling needs
            (the chain child is a draw from q only if it is always in the tree) and with ``force_accept`` (its
            accepted node is the chain's). Under the planner (``budget="auto"``) at T = 0 its trees are best first
            too, so its paired observation of the chain (the chain nodes on a tree's accepted path) is censored
            where a tree dropped the chain's deeper nodes: the chain is undervalued then (``infer.planner``,
            "Paired observations"; docs/planner.md, "Engine defaults"). True: chain first everywhere; for a draft that is right but
            unsure at its deep slots, whose best-first trees trade deep chain nodes for siblings that fail.
            False: never; refused at T > 0 and with ``force_accept`` (:meth:`generate` raises ValueError).
        budget: "auto" = the verify-budget planner (``infer.planner``) picks AR, the chain or a tree of
            ``plan_trees`` nodes per step from step times measured at start-up, corrected by the measured
            time of every step it runs (GPU: CUDA events between the snapshots around the step; CPU: host
            time from its launch to the next: no extra sync; ``plan_online = False`` keeps the start-up
            table), and the measured acceptance;
            once no prompt is queued, it compares the modes on the time to finish the batch's last request
            (``plan_drain``, on by default; ``plan_drain_model``, ``infer.planner.DRAIN_MODELS``: how it maps a
            tree to one request, "persist" by default; per-slot chain acceptance counted by :meth:`_decode_planned`);
            None = always ``verify`` / ``tree_budget``. The planner's AR steps defer the draft-context
            append to a flush every ``ar_defer`` AR steps and before a speculative one (:meth:`_ar_step`,
            :meth:`_decode_planned`; ``defer_ar_append = False``: append in every AR step, tests and
            benchmarks).
        plan_trees: the planner's tree sizes, a tuple or list (nodes, anchor included, each 2..64, distinct;
            ``budget="auto"`` only; raises ValueError otherwise). None: ``PLAN_TREES``; ``()``: AR and the chain only.
            Where the trees keep the chain first (T > 0), the tree of ``verify_size`` nodes is the chain and the
            planner leaves it out (:meth:`planner_modes`).
        plan_chains: the planner's chains narrower than ``verify_size``, a tuple or list of widths (anchor included,
            each 2..verify_size - 1, distinct; ``budget="auto"`` only; raises ValueError otherwise). None:
            ``PLAN_CHAINS``, those below ``verify_size``. A chain of W drafts the whole block and verifies its first W
            slots (:meth:`_spec_step`); a wider chain's or a tree's step tells the planner what each narrower chain
            would have committed (:meth:`_decode_planned`, "Paired observations").
        exact: bit-exact mode (issue 13; default ``infer.model.EXACT_DEFAULT``): the target's decode and
            verify steps use row-invariant kernels and each prompt is prefilled in its own pass, so
            greedy speculative output equals this engine's autoregressive output bit for bit, in
            bf16 too, at any batch size, with or without CUDA graphs; with tree verify and with the planner too
            (a tree node's target logits are those of its path decoded one token at a time, issue 16).
        prefill_buckets: prefill each prompt alone, padded to a length bucket (``infer.model.prefill_bucket``)
            at static shapes (:meth:`EngineTarget.prefill_static`), as one CUDA graph per bucket when
            ``cuda_graphs`` (made at a bucket's first prompt): the eager prefill of a small target is bound
            by its ~12 launches per layer (16 ms for a repeated length of the SmolLM2 shape on an H200,
            results/prefill-h200.json). None = ``PREFILL_BUCKETS_AUTO`` and CUDA graphs and an
            attention-only target of hidden size <= ``PREFILL_BUCKETS_MAX_HIDDEN`` (large targets' prefill is
            compute-bound: padding would only add work). An admission of more than
            ``PREFILL_BUCKETS_MAX_PROMPTS`` prompts (8; the batch's first, a large refill) takes the packed pass
            instead, which is faster for many prompts (one pass, not one per prompt), except in exact mode, where
            every prompt is prefilled alone anyway.
        draft_vocab: token ids the draft may propose (int [N], N in 64..V, distinct; ``dspine.draft_vocab``), or
            None (the whole vocabulary). The draft's logits are computed over those rows of the target's head only
            (a copy of N x H weights is kept); the other tokens get the dtype's lowest finite logit, so p_d = 0
            there. Lossless either way (the target verifies); a token outside the set is never drafted. All V ids
            are the same as None (``draft_vocab`` and ``draft_head`` stay None).
            Raises ValueError (naming the first bad id) for ids :func:`dspine.draft_vocab.check_draft_vocab`
            refuses, or given without a draft.
    """

    # prefill_buckets=None's default; an admission of more than PREFILL_BUCKETS_MAX_PROMPTS prompts takes the packed
    # pass (docs/planner.md, "Engine defaults")
    PREFILL_BUCKETS_AUTO = True
    PREFILL_BUCKETS_MAX_HIDDEN = 2048
    PREFILL_BUCKETS_MAX_PROMPTS = 8
    # the planner's trees (docs/planner.md, "Engine defaults"; a step of the larger tree also gives the smaller one's
    # tokens, infer.planner "Paired observations")
    PLAN_TREES = (16, 32)
    # the planner's chains narrower than verify_size (plan_chains; widths, anchor included; those not below
    # verify_size are dropped from this default): at high concurrency a chain's verify rows (B x width) set its step
    # time, and a weak draft rarely gets its deep slots accepted, so a short chain beats both AR and the full chain
    # where the full chain loses to AR (H100, the shipped SmolLM2 draft: docs/planner.md, the README's chain table,
    # results/verify-chains-{invariant,exact}-h100.json)
    PLAN_CHAINS: tuple[int, ...] = (2, 4, 8)
    # planner AR steps per draft-context flush (F): a flush is one append of [B, F, k·H] (static shape,
    # whatever is pending), about as many launches as one per-step append, shared by up to F AR steps; its
    # fc and K/V GEMMs run over B·F rows, like the draft block's B·16 rows of the shipped drafts (block 16)
    # in every speculative step, so a larger F buys little amortisation for GEMMs that are no longer
    # launch-bound and a larger static buffer (benchmarks/engine/bench_planner_ar.py measures the flush)
    AR_DEFER = 16
    # planner choices per refresh of the drain rule's request list once no prompt is queued (infer.planner, "Drain";
    # StepPlanner.choose keeps the last one in force in between)
    PLAN_DRAIN_EVERY = 8

    def __init__(self, target: EngineTarget, draft: DSpineDraftModel | None, eos_token_ids, max_batch: int = 8,
                 max_seq: int = 4096, cuda_graphs: bool | None = None, verify_size: int | None = None,
                 force_accept: int | None = None, max_new_cap: int | None = None, verify: str = "chain",
                 tree_budget: int = 32, budget: str | None = None, exact: bool | None = None,
                 prefill_buckets: bool | None = None, tree_chain_first: bool | None = None,
                 plan_trees: tuple[int, ...] | None = None, draft_vocab: torch.Tensor | None = None,
                 plan_chains: tuple[int, ...] | None = None):
        self.target = target
        self.exact = EXACT_DEFAULT if exact is None else bool(exact)
        if target.args.hybrid and (verify != "chain" or budget is not None or exact):
            raise ValueError(f"target model_type={target.args.model_type!r} (linear-attention layers): the engine "
                             f"runs chain verify only, without exact mode (got verify={verify!r}, budget={budget!r}, "
                             f"exact={exact!r}); a token tree would need tree-masked recurrent states")
        self.device = target.embed.device
        self.impl = target.impl
        # programmatic dependent launch for this target's kernels (dspine.ops._common: on for hidden >= 2048,
        # where it was measured to help; DSPINE_PDL overrides), set before any graph is captured
        self.pdl_mode = set_pdl_auto(target.args.hidden_size)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        if prefill_buckets is None:
            prefill_buckets = (self.PREFILL_BUCKETS_AUTO and self.cuda_graphs and not target.args.hybrid
                               and target.args.hidden_size <= self.PREFILL_BUCKETS_MAX_HIDDEN)
        if prefill_buckets and target.args.hybrid:
            raise ValueError(f"prefill_buckets=True: target model_type={target.args.model_type!r} has linear-attention "
                             "layers, whose recurrent state would run over the padding")
        self.prefill_buckets = bool(prefill_buckets)
        # (bucket, want_features, batch size with the draft-context append or None) -> (graph or None, static
        # inputs, static outputs, the eager call)
        self._prefill_graphs: dict[tuple, tuple] = {}
        self._prefill_pool = None  # the CUDA graph memory pool the prefill graphs share
        check_target_dtype(target.embed.dtype, target.args.model_type)
        if draft is not None:
            draft = draft.to(device=self.device, dtype=target.embed.dtype).eval().fuse_weights()
        self.draft = draft
        if draft_vocab is not None and draft is None:
            raise ValueError("draft_vocab needs a draft (it selects the tokens the draft may propose)")
        # ids [N] int64 and the head's rows W[ids] [N, H]; None for the whole vocabulary
        self.draft_vocab, self.draft_head = head_rows(draft_vocab, target.head)
        self.block_size = draft.config.block_size if draft is not None else 1
        self.verify_size = verify_size or self.block_size
        if not 1 <= self.verify_size <= self.block_size:
            raise ValueError(f"verify_size={verify_size} must be in 1..{self.block_size} (the draft's block size)")
        self.force_accept = force_accept
        if verify not in ("chain", "tree"):
            raise ValueError(f"verify={verify!r} must be 'chain' or 'tree'")
        if verify == "tree" and (draft is None or verify_size not in (None, self.block_size)
                                 or not 2 <= tree_budget <= 64):
            raise ValueError(f"verify='tree' needs a draft, no verify_size and tree_budget in 2..64 (got "
                             f"{tree_budget})")
        if budget not in (None, "auto") or (budget == "auto" and draft is None):
            raise ValueError(f"budget={budget!r} must be None or 'auto' (the planner needs a draft)")
        self.verify, self.tree_budget, self.budget = verify, tree_budget, budget
        if not (tree_chain_first is None or isinstance(tree_chain_first, bool)):
            raise ValueError(f"tree_chain_first={tree_chain_first!r} must be None, True or False")
        self.tree_chain_first = tree_chain_first
        self.mode = ("tree", tree_budget) if verify == "tree" else ("chain", self.verify_size)
        trees = tuple(self.PLAN_TREES) if plan_trees is None else plan_trees
        if (not isinstance(trees, (tuple, list)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in trees)
                or not all(2 <= n <= 64 for n in trees) or len(set(trees)) != len(trees)):
            raise ValueError(f"plan_trees={plan_trees!r} must be a tuple or list of distinct integer tree sizes in 2..64 "
                             "(nodes, anchor included), or empty (the planner then picks AR or the chain)")
        if plan_trees is not None and budget != "auto":
            raise ValueError(f"plan_trees={plan_trees!r} applies to budget='auto' only (got budget={budget!r})")
        if budget == "auto" and trees and self.verify_size != self.block_size:
            # a tree is as deep as the draft block: its steps commit up to block_size tokens, which slots sized for
            # a narrower chain cannot hold
            raise ValueError(f"budget='auto' with trees {tuple(trees)} needs verify_size equal to the draft's block "
                             f"size {self.block_size} (got {self.verify_size}); pass plan_trees=() for AR and a "
                             "narrower chain (infer.generate --plan-trees none, infer.bench --config "
                             "LABEL:plan_trees=none)")
        windows = sorted({w for w in target.args.windows if w is not None})
        if windows and ((verify == "tree" and budget is None) or (budget == "auto" and trees)):
            raise ValueError(f"the target has sliding-window layers (windows {windows}): tree verify has no window; "
                             f"use verify='chain' (--verify chain), and with budget='auto' plan_trees=() (--plan-trees "
                             f"none, --config LABEL:plan_trees=none); got verify={verify!r}, budget={budget!r}, "
                             f"plan_trees={plan_trees!r}")
        self.plan_trees = tuple(sorted(trees))
        self._inner_size_cache: dict[int, torch.Tensor] = {}  # _inner_sizes
        chains = tuple(n for n in self.PLAN_CHAINS if n < self.verify_size) if plan_chains is None else plan_chains
        if (not isinstance(chains, (tuple, list))
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in chains)
                or not all(2 <= n < self.verify_size for n in chains) or len(set(chains)) != len(chains)):
            raise ValueError(f"plan_chains={plan_chains!r} must be a tuple or list of distinct integer chain widths in "
                             f"2..{self.verify_size - 1} (anchor included, narrower than verify_size="
                             f"{self.verify_size}), or empty")
        if plan_chains and budget != "auto":
            raise ValueError(f"plan_chains={plan_chains!r} applies to budget='auto' only (got budget={budget!r})")
        self.plan_chains = tuple(sorted(chains)) if budget == "auto" else ()
        self.plan_modes = ([("ar", 1)] + [("chain", n) for n in self.plan_chains] + [("chain", self.verify_size)]
                           + [("tree", n) for n in self.plan_trees])
        # target positions written per step (anchor included)
        self.verified_per_step = tree_budget if verify == "tree" else self.verify_size
        if budget == "auto":
            self.verified_per_step = max((self.verify_size, *self.plan_trees))
        self.planner_report: dict | None = None
        self.slot_owner: list[int | None] | None = None  # generate: prompt index per slot, None = free
        self.plan_online = True  # the planner learns step times from the measured wall time per step
        # when the planner gets the draft's chain confidence (_decode_planned): "greedy" (T = 0 only), "always",
        # "never". At T > 0 it is Π q(sampled token), not the acceptance Σ min(p, q) it would have to predict
        # (docs/planner.md, "Engine defaults")
        self.plan_confidence = "greedy"
        # how far that confidence moves the planner's estimate (StepPlanner's conf_slope): "auto", the slope fitted
        # online; 1.0, in proportion (the rule before 2026-12-05); 0, not at all
        self.plan_conf_slope: float | str = "auto"
        self.plan_state = "steps"  # infer.planner.PLAN_STATES: "kv" prices the KV length, "rows_kv" also weighs rows
        # benchmarks only: a fixed cycle of plan_modes the planner runs instead of deciding (StepPlanner.schedule)
        self.plan_schedule: list | None = None
        self.ar_defer = self.AR_DEFER  # F, read once per batch size when its slots are made (_Slots.pend_max): set it
        # before the first generate at that batch size; later changes do not reach slots already made
        self.defer_ar_append = True  # False: the planner's AR steps append to the draft context each step
        # the planner's admissions while AR is its best mode (StepPlanner.drafting_pays) keep the prompts' target
        # features and write their draft context before the first speculative step (_write_deferred), not in the
        # admission: at concurrency 64, T = 1 the planner ran AR at every step and its admissions' context writes
        # cost 5 ms a task of 0.8 s (results/verify-invariant-h200.json, per_task prefill_s). False: always write
        self.plan_defer_prompt = True
        self._costs: dict[tuple, dict] = {}
        # what the planner learned, per _plan_key, kept from one generate to the next (infer.planner, "Across
        # calls"): the online cost model (with plan_online) and, with plan_memory, the acceptance
        self.plan_cost_memory: dict[tuple, dict] = {}  # StepPlanner.cost_state() of the last generate
        self.plan_token_memory: dict[tuple, dict] = {}  # StepPlanner.token_state() of the last generate
        self.plan_memory = True  # False: every generate's planner starts with no token averages
        # once no prompt is queued, the planner compares modes on the time to finish the last live request
        # (infer.planner, "Drain"); False: on tokens per millisecond to the end
        self.plan_drain = True
        self.plan_drain_model = "persist"  # infer.planner.DRAIN_MODELS: how the drain rule maps a tree to one request
        # what a DSPINE_PLAN_LOG line says this call was (e.g. infer.bench's label, task, turn and pass); None: nothing
        self.plan_log_tag: dict | None = None
        self.eos = torch.tensor(sorted(set(int(e) for e in eos_token_ids)) or [-1], device=self.device)
        self.eos_set = set(int(e) for e in eos_token_ids)
        self.max_batch, self.max_seq = max_batch, max_seq
        limits = {"target": target.args.max_position_embeddings}
        if draft is not None:
            limits["draft"] = draft.config.max_position_embeddings
        for who, limit in limits.items():
            if max_seq > limit:
                raise ValueError(f"engine context max_seq={max_seq} exceeds the {who}'s max_position_embeddings="
                                 f"{limit} (docs/method.md §8.11)")
        self.max_new_cap = max_new_cap or max_seq
        capacity = max_seq + max(self.block_size, self.verified_per_step) + 1
        self.cache: KVCache = target.new_cache(max_batch, capacity)
        self.draft_cache = DraftCache(draft, max_batch, capacity) if draft is not None else None
        self._slots: dict[int, _Slots] = {}
        self._graphs: dict[tuple, object] = {}
        self._capture_stream = None  # torch.cuda.Stream of this engine's captures (made at the first one)
        # LM head per row count M -> dspine.ops.lm_head candidate, filled by _tune_lm_head
        self.lm_head_choice: dict[int, str] = {}
        self.draft_lm_head_choice: dict[int, str] = {}  # the same for the draft vocabulary's head
        self.lm_head_tune = self.device.type == "cuda" and self.impl == "triton" and not self.exact
        self.lm_head_timer = None  # timer(name, fn) -> µs for lm_head.pick (None: CUDA events)
        # the last generate call's loop: seconds launching steps, waiting for the device's flags, in host
        # bookkeeping (flags, harvest), admitting (prefill); steps, wall_s, tokens (benchmarks, --profile); on CUDA
        # admit_device_s (the admissions' device time: from the end of the step in flight to the admission's end);
        # admits: the admissions (prefill calls) of the call; with a planner, flushes: its draft-context flushes
        self.loop_profile: dict = {}
        # benchmarks: time every decode step on the device too (CUDA events around each step of the loop without
        # a planner: loop_profile["device_step_s"], their sum, and "device_loop_s", first step's start to the last
        # one's end, refills' prefills inside it included), so the loop's time outside the steps can be told from
        # slower steps
        self.profile_device = False

    # -- state views ---------------------------------------------------------------------------
    def _slots_for(self, B: int) -> _Slots:
        if B not in self._slots:
            cfg = self.draft.config if self.draft is not None else None
            pending = None
            if self.budget == "auto":  # the planner's deferred AR appends (_ar_step)
                if not isinstance(self.ar_defer, int) or self.ar_defer < 1:
                    raise ValueError(f"Engine.ar_defer={self.ar_defer!r}: must be an int >= 1 (AR steps per "
                                     "draft-context flush); defer_ar_append = False appends in every AR step")
                pending = (self.ar_defer, self.draft.fc.in_features, self.target.embed.dtype)
            inner = max(len(self.plan_trees) - 1, 0) if self.budget == "auto" else 0  # planner trees inside others
            for n in self.plan_trees if self.budget == "auto" else ():  # made here, not inside a graph's capture
                self._inner_sizes(n)
            self._slots[B] = _Slots(B, self.verify_size, self.block_size, self.max_new_cap, self.device,
                                    cfg.mask_token_id if cfg else 0, pending, inner)
        return self._slots[B]

    def _cache_view(self, B: int):
        """The first B rows of the target cache and of the draft cache (whose lengths are the slots')."""
        kv, draft_cache = self.cache.view(B), None
        if self.draft_cache is not None:
            draft_cache = self.draft_cache.view(B, lengths=self._slots_for(B).lengths)
        return kv, draft_cache

    def draft_logits(self, block: torch.Tensor, draft_cache: DraftCache, spread: bool = True,
                     width: int | None = None) -> torch.Tensor:
        """Draft logits ``[B, W-1, V]`` (model dtype; W = ``width``, default ``verify_size``) for blocks ``[B, bs]`` =
        [anchor, MASK, ...] whose anchor sits at ``draft_cache.lengths[b]``: the draft over the target's embedding and
        head, for the block's slots 1 .. W - 1 (the draft runs over the whole block; the head over those rows only).
        With a draft vocabulary and ``spread=False``: ``[B, W-1, N]``, column j for token ``draft_vocab[j]``."""
        W = width or self.verify_size
        hidden = self.draft.forward_block(F.embedding(block, self.target.embed), draft_cache, impl=self.impl)
        rows = block.shape[0] * (W - 1)
        h = hidden[:, 1:W]
        if self.draft_head is None:
            return self.target.logits(h, lm_head=self.lm_head_choice.get(rows, "linear"))
        # draft vocabulary (dspine.draft_vocab): logits of its N rows of the head [B, K, N], spread into [B, K, V]
        sub = lm_head_op(h, self.draft_head, self.draft_lm_head_choice.get(rows, "linear"))
        return spread_logits(sub, self.draft_vocab, self.target.head.shape[0]) if spread else sub

    def _tune_lm_head(self, rows: list[int], draft_rows: int | None = None) -> None:
        """Pick the LM head's implementation for each row count in ``rows`` not picked yet, and for the draft's
        ``draft_rows`` over the draft vocabulary's head if there is one (µs per candidate timed by
        ``dspine.ops.lm_head.pick``; one log line per row count)."""
        heads = [(M, self.target.head, self.lm_head_choice, "lm_head") for M in rows]
        if draft_rows is not None:
            if self.draft_head is None:
                heads.append((draft_rows, self.target.head, self.lm_head_choice, "lm_head"))
            else:
                heads.append((draft_rows, self.draft_head, self.draft_lm_head_choice, "draft lm_head"))
        for M, head, choices, name in heads:
            if not self.lm_head_tune or M < 1 or M in choices:
                continue
            best, times = pick_lm_head(M, head, timer=self.lm_head_timer)
            choices[M] = best
            print(f"{name} M={M} N={head.shape[0]}: {best} ({times[best]:.0f} us; "
                  + ", ".join(f"{n} {t:.0f}" for n, t in times.items()) + ")", flush=True)

    # -- the steps -------------------------------------------------------------------------------
    @staticmethod
    def _attn_lengths(s: _Slots) -> torch.Tensor:
        """``[B]`` int32: the cache lengths a target step takes, ``s.lengths`` with 0 for a finished or idle row
        (``done``). The step computes every row; at its own length a done row's attention would read its whole
        cache, as a live row's does (on the H100 the chain of 4's step at concurrency 64 rose from 1.91 to 2.07 ms
        as gsm8k's requests finished), at 0 it reads its few new positions. It commits nothing, so what it computes
        and writes there is never read; a live row's result is unchanged (each row attends to its own cache, and
        the split plan follows the cache's size, not the lengths). One row: ``s.lengths``, no kernel (it is done only
        in the idle step after its request finishes, one step a request). The draft's context attention still reads a
        done row's whole context (``DraftCache.lengths`` is ``s.lengths``)."""
        return s.lengths if s.B == 1 else s.lengths * (s.done == 0)

    def _spec_step(self, slots: _Slots, kv: KVCache, draft_cache: DraftCache, params: SamplingParams,
                   mode: tuple[str, int] | None = None):
        """One speculative step for all B slots, without host sync (the CUDA graph's body).

        ``mode``: ``("chain", W)``, W the chain's width (default the engine's: W = verify_size); a narrower one (a
        planner chain of ``plan_chains``) drafts the whole block but takes the head and verifies over its first W
        slots only. Draft logits ``[B, K, V]`` (K = W - 1; greedy with a draft vocabulary ``[B, K, N]``, the argmax
        mapped through ``draft_vocab``) of ``draft_block`` -> draft tokens
        ``[B, K]`` int64 (argmax, or sampled from p_d ``[B, K, V]`` fp32 at output positions
        out_len + k - 1) -> the verify block ``[B, W]`` (``verify_block`` when W = verify_size) through the target at
        positions ``lengths[b] + t``: logits ``[B, W, V]`` and features ``[B, W, k·H]`` ->
        accepted ``a [B]`` int32 and bonus ``[B]`` int64 -> commit into out_tokens / out_len / done /
        hist -> the committed a + 1 feature rows into the draft context (lengths += a + 1 for live
        rows) -> anchor = bonus. Idle rows (done = 1) compute but change nothing; non-finite logits
        set ``nonfinite`` (checked by the host once per step).
        """
        mode = mode or self.mode
        if mode[0] == "tree":
            return self._tree_step(slots, kv, draft_cache, params, mode[1])
        # W: this chain's width; a planner chain narrower than the slots' verify_size (plan_chains) verifies the
        # block's first W - 1 draft tokens: its own verify block, the slots' offsets [:W] and hist[:, :W + 1]
        s, W = slots, mode[1]
        K, narrow = W - 1, W < slots.verify_size
        s.draft_block[:, 0] = s.anchor
        # greedy with a draft vocabulary: argmax over its N columns, then the ids (the ids ascend, so ties go to
        # the lower id as over all V columns): no [B, K, V] logits at all
        sub = params.greedy and self.draft_vocab is not None
        wide = {"width": W} if narrow else {}  # (tests replace draft_logits by oracles that take no width)
        d_logits = (self.draft_logits(s.draft_block, draft_cache, spread=False, **wide) if sub
                    else self.draft_logits(s.draft_block, draft_cache, **wide))[:, :K]  # (an oracle gives them all)
        s.nonfinite[1] |= ~torch.isfinite(d_logits).all()
        if params.greedy:
            if self.budget == "auto":  # the argmax and its probability in one pass over [B, K, V]
                # (dspine.ops.argmax_prob; docs/planner.md, "Engine defaults")
                draft_tokens, p_top = argmax_prob(d_logits, impl=self.impl)
                plan_stats(p_top, s.conf, impl=self.impl)  # conf = chain_confidence(p_top) in one launch
            else:
                draft_tokens = d_logits.argmax(-1)
            if sub:
                draft_tokens = self.draft_vocab[draft_tokens]
        else:
            out_pos = s.out_len.long()  # [B] the step's first output position
            slot_pos = out_pos[:, None] + s.offsets[:K]  # [B, K]: draft token k at n + k - 1
            p_draft, d_ids = draft_distribution(d_logits, params, self.impl)
            # invariant: the draft races with the noise the target's own draw uses at each output position
            stream = rng.STREAM_TARGET if params.invariant_sampling else rng.STREAM_DRAFT
            draft_tokens = sample(p_draft, s.seeds, stream, slot_pos, d_ids, impl=self.impl)
            if self.budget == "auto":
                plan_stats(self._conf_probs(d_logits, p_draft, params, self.impl).gather(-1, draft_tokens[..., None])[..., 0],
                           s.conf, impl=self.impl)
        if narrow:
            block = torch.cat([s.anchor[:, None], draft_tokens], dim=1)  # [B, W]
        else:
            block = torch.cat([s.anchor[:, None], draft_tokens], dim=1, out=s.verify_block)
        offsets = s.offsets[:W]
        cl = self._attn_lengths(s)
        positions = cl[:, None] + offsets  # [B, W] int64
        t_logits, feats = self.target.forward_step(block, positions, kv, cl, exact=self.exact,
                                                   lm_head=self.lm_head_choice.get(block.numel(), "linear"))
        s.nonfinite[0] |= ~torch.isfinite(t_logits).all()
        if self.force_accept is not None:
            a = torch.full((s.B,), min(self.force_accept, K), dtype=torch.int32, device=self.device)
            bonus = t_logits.argmax(-1).gather(1, a[:, None].long())[:, 0]
        elif params.greedy:
            a, bonus = accept_greedy(draft_tokens, t_logits.argmax(-1), impl=self.impl)
        else:
            p_target, t_ids = logits_to_probs(t_logits, params.temperature, params.top_p, params.top_k, with_ids=True,
                                             impl=self.impl)
            if params.invariant_sampling:  # the target's own draw at every position; the matching prefix passes
                draws = sample(p_target, s.seeds, rng.STREAM_TARGET, out_pos[:, None] + offsets, t_ids,
                               impl=self.impl)
                a, bonus = accept_greedy(draft_tokens, draws, impl=self.impl)
            else:
                u = rng.uniforms(s.seeds, rng.STREAM_ACCEPT, slot_pos)
                noise = rng.bonus_noise(s.seeds, rng.STREAM_TARGET, out_pos, p_target.shape[-1], t_ids)
                a, bonus = accept_sample(draft_tokens, p_target, p_draft, u, noise, impl=self.impl)
        live = s.done == 0
        self.target.commit_states(kv, (a + 1) * live)  # hybrid targets: linear-layer states keep a + 1 tokens
        commit_step(block, a, bonus, s.out_tokens, s.out_len, s.max_new, s.done, self.eos, s.hist[:, : W + 1],
                    impl=self.impl, anchor=s.anchor)  # anchor = bonus for live rows
        draft_cache.append(feats, (a + 1) * live, impl=self.impl)  # a int32; advances s.lengths

    def _inner_sizes(self, n: int) -> torch.Tensor:
        """``[S]`` int64 on the engine's device: the planner's tree sizes below ``n`` (the trees inside a tree step
        of ``n`` nodes), in ``plan_trees`` order; made once per ``n`` and kept, so a CUDA graph that captured it reads
        the same memory at every replay (``dspine.ops.plan_stats``)."""
        if n not in self._inner_size_cache:
            sizes = [m for m in self.plan_trees if m < n]
            self._inner_size_cache[n] = torch.tensor(sizes, dtype=torch.int64, device=self.device)
        return self._inner_size_cache[n]

    @staticmethod
    def _conf_probs(d_logits: torch.Tensor, p_draft: torch.Tensor, params: SamplingParams,
                    impl: str = "torch") -> torch.Tensor:
        """The draft distribution the planner's confidence reads at T > 0 (``[B, K, V]`` fp32): the sampling
        distribution ``p_draft``, or, with a draft temperature, the draft at the target's temperature and
        cuts (the sampled q is sharper than the acceptance it predicts, one-hot at draft temperature 0)."""
        if params.draft_temperature is None:
            return p_draft
        return logits_to_probs(d_logits, params.temperature, params.top_p, params.top_k, impl=impl)

    def chain_first(self, params: SamplingParams) -> bool:
        """Whether this run's trees keep the chain first (``tree_chain_first``; None: at T > 0 and with
        ``force_accept`` only). Raises ValueError for ``tree_chain_first=False`` at T > 0 or with ``force_accept``
        (whose accepted node is the chain's at the forced depth)."""
        if self.tree_chain_first is None:
            return not params.greedy or self.force_accept is not None
        if not self.tree_chain_first and not params.greedy:
            raise ValueError(f"tree_chain_first=False at temperature {params.temperature}: the tree's rejection "
                             "sampling needs the sampled chain in every tree (use None or True)")
        if not self.tree_chain_first and self.force_accept is not None:
            raise ValueError("tree_chain_first=False with force_accept: the forced acceptance takes the chain's node "
                             "at that depth, which a best-first tree may not hold (use None or True)")
        return self.tree_chain_first

    def _tree_step(self, slots: _Slots, kv: KVCache, draft_cache: DraftCache, params: SamplingParams, N: int):
        """One tree-verify step for all B slots, without host sync (``dspine.tree``).

        Draft distributions ``[B, K, V]`` -> chain tokens (argmax, or sampled as in :meth:`_spec_step`)
        -> a best-first tree of N nodes ``[B, N]`` -> the target over the nodes at RoPE
        positions lengths + depth, K/V written at rows lengths + node, tree attention (ancestor
        bitmasks) -> acceptance and the accepted path (``dspine.ops.tree_verify``; with ``force_accept``, the chain
        node at that depth, no acceptance kernel) -> the path's K/V rows moved to rows lengths .. lengths + a (one
        gather, then one scatter, over every attention layer's K and V) -> commit -> the path's features into the draft
        context -> anchor = bonus.
        """
        s, K = slots, self.block_size - 1
        s.draft_block[:, 0] = s.anchor
        d_logits = self.draft_logits(s.draft_block, draft_cache)
        s.nonfinite[1] |= ~torch.isfinite(d_logits).all()
        out_pos = s.out_len.long()
        if params.greedy:  # chain = q's argmax (ties: the lower id): build_tree_fused finds it with the candidates
            q, chain = torch.softmax(d_logits.float(), -1), None
        else:
            q, d_ids = draft_distribution(d_logits, params, self.impl)
            chain = sample(q, s.seeds, rng.STREAM_DRAFT, out_pos[:, None] + torch.arange(K, device=self.device), d_ids,
                           impl=self.impl)
        # one Triton program per row builds the tree, its ancestor mask and bits (dspine.ops.tree_build), after
        # the per-depth candidates (two more launches); bits [B, N] int64: the tree attention's mask and the verify's ancestors
        tree = build_tree_fused(s.anchor, q, N, chain_tokens=chain, impl=self.impl,
                                chain_first=self.chain_first(params))
        bits = tree.bits
        cl = self._attn_lengths(s)
        positions = cl[:, None].long() + tree.depth
        t_logits, feats = self.target.forward_step(tree.tokens, positions, kv, cl, tree_bits=bits,
                                                   exact=self.exact,
                                                   lm_head=self.lm_head_choice.get(tree.tokens.numel(), "linear"))
        s.nonfinite[0] |= ~torch.isfinite(t_logits).all()
        rows = torch.arange(s.B, device=self.device)
        # path [B, Kp + 1]: node at depth d (identity past depth a); a tree of N nodes is at most N - 1 deep, so a
        # budget below the block keeps the path (and the K/V move) to N entries. dspine.ops.tree_verify returns it
        # with the acceptance (a fixed number of launches whatever N: no per-node loop)
        Kp = min(K, N - 1)
        if self.force_accept is not None:  # the chain node at depth a
            a = torch.full((s.B,), min(self.force_accept, K, N - 1), dtype=torch.int32, device=self.device)
            last = (tree.chain & (tree.depth == a[:, None])).int().argmax(1)
            bonus = t_logits[rows, last].argmax(-1)
            path = path_nodes(tree, last, Kp)
        elif params.greedy:
            last, a, bonus, path = verify_tree_greedy(tree.tokens, tree.parent, tree.depth, bits,
                                                      t_logits.argmax(-1), impl=self.impl, path_depth=Kp)
        else:
            p_target, t_ids = logits_to_probs(t_logits, params.temperature, params.top_p, params.top_k, with_ids=True,
                                             impl=self.impl)
            noise = rng.bonus_noise(s.seeds, rng.STREAM_TARGET, out_pos, p_target.shape[-1], t_ids)
            last, a, bonus, path = verify_tree_sample(tree.tokens, tree.parent, tree.depth, tree.chain, p_target, q,
                                                      node_uniforms(tree, s.seeds, out_pos), noise, impl=self.impl,
                                                      path_depth=Kp)
        live = s.done == 0
        if self.budget == "auto":  # one launch (dspine.ops.plan_stats): the chain's confidence (_spec_step; with trees
            # the planner's chain is the block's K slots; q of the chain tokens comes with the candidates, except under
            # a draft temperature) and the paired observation of the chain (dspine.tree.chain_accepted; infer.planner,
            # "Paired observations")
            p_chain = (tree.chain_q if params.greedy or params.draft_temperature is None else
                       self._conf_probs(d_logits, q, params).gather(-1, chain[..., None])[..., 0])
            # and the planner trees inside this one (infer.planner, "Paired observations"): their accepted draft
            # tokens, columns in plan_trees order, in the same launch
            sizes = self._inner_sizes(N)  # none for the smallest planner tree: plan_stats then writes none
            plan_stats(p_chain, s.conf, tree.chain, path, a, s.chain_acc, impl=self.impl, rank=tree.rank, sizes=sizes,
                       inner_acc=s.inner_acc[: sizes.shape[0]])
        tok = tree.tokens.gather(1, path)
        if Kp < K:  # commit_step takes the block's K + 1 columns; those past depth a are never read
            tok = torch.cat([tok, tok.new_zeros(s.B, K - Kp)], 1)
        commit_step(tok, a, bonus, s.out_tokens, s.out_len, s.max_new, s.done, self.eos, s.hist, impl=self.impl)
        src = s.lengths[:, None].long() + path
        dst = s.lengths[:, None].long() + torch.arange(Kp + 1, device=self.device)
        two, La, _, Hkv, _, D = kv.kv.shape  # every attention layer's K and V at once: all reads, then the writes
        src, dst = (i[None, None, :, None, :, None].expand(two, La, -1, Hkv, -1, D) for i in (src, dst))
        kv.kv.scatter_(4, dst, kv.kv.gather(4, src))
        path_feats = feats.gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))
        draft_cache.append(path_feats, (a.to(torch.int32) + 1) * live, impl=self.impl)  # advances s.lengths
        s.anchor.copy_(torch.where(live, bonus, s.anchor))

    def _ar_step(self, slots: _Slots, kv: KVCache, params: SamplingParams, draft_cache: DraftCache | None = None,
                 defer: bool = False):
        """One autoregressive step for all B slots: the anchor through the target at position ``lengths``,
        next token (argmax, or sampled at output position ``out_len``), commit; ``lengths += live``.

        With ``draft_cache`` (a planner's AR step between speculative ones) the anchor's target features
        ``[B, 1, k·H]`` are kept for the draft context: ``defer`` (the planner's default) writes them into
        ``pend_feats[b·F + pend_count[b]]`` of the live rows (a row past F writes nothing) and
        ``pend_count += live``, ``lengths += live`` (:func:`dspine.ops.defer.defer_features`, one kernel, before
        the commit), for :meth:`_flush_step` to append later (the host flushes after F AR
        steps and before a speculative step: :meth:`_decode_planned`); without ``defer`` they are appended
        now (``DraftCache.append``: fc GEMM, norm, per draft layer a K/V GEMM and the cache write)."""
        s = slots
        tok = s.anchor[:, None]
        cl = self._attn_lengths(s)
        logits, feats = self.target.forward_step(tok, cl[:, None].long(), kv, cl,
                                                 want_features=draft_cache is not None, exact=self.exact,
                                                 lm_head=self.lm_head_choice.get(s.B, "linear"))
        logits = logits[:, 0]
        s.nonfinite[0] |= ~torch.isfinite(logits).all()
        if params.greedy:
            nxt = logits.argmax(-1)
        else:
            probs, ids = logits_to_probs(logits, params.temperature, params.top_p, params.top_k, with_ids=True,
                                         impl=self.impl)
            nxt = sample(probs, s.seeds, rng.STREAM_TARGET, s.out_len.long(), ids, impl=self.impl)
        defer = draft_cache is not None and defer
        if defer:  # one kernel, before the commit changes done (dspine.ops.defer)
            defer_features(feats[:, 0], s.done, s.pend_feats, s.pend_count, s.lengths, s.pend_max, impl=self.impl)
        else:
            live = s.done == 0
        commit_step(tok, s.no_draft, nxt, s.out_tokens, s.out_len, s.max_new, s.done, self.eos, s.hist[:, :2],
                    impl=self.impl, anchor=s.anchor)
        if defer:
            return
        if draft_cache is None:
            s.lengths.add_(live)
        else:
            draft_cache.append(feats, live.to(torch.int32), impl=self.impl)

    def _flush_step(self, slots: _Slots, draft_cache: DraftCache):
        """The deferred draft-context append of the planner's AR steps (no host sync; a CUDA graph of its
        own, not a planner mode): ``pend_lengths = lengths - pend_count``, then ``append_context`` of
        ``pend_feats [B, F, k·H]`` with counts ``pend_count`` over ``draft_cache``, a view whose lengths are
        ``pend_lengths`` (so row b's pending features go to positions lengths[b] - pend_count[b] ..
        lengths[b] - 1, and the append advances ``pend_lengths`` to ``lengths``), then ``pend_count = 0``.
        Rows with none pending write only the cache's scratch slot."""
        s = slots
        torch.sub(s.lengths, s.pend_count, out=s.pend_lengths)
        draft_cache.append(s.pend_feats[:-1].view(s.B, s.pend_max, -1), s.pend_count, impl=self.impl)
        s.pend_count.zero_()

    def _runner(self, B: int, params: SamplingParams, spec: bool, mode: tuple[str, int] | None = None):
        """The step for this configuration: a replayable CUDA graph, or the eager function. ``mode``
        (planner): ("ar", 1) | ("chain", n) | ("tree", n), default the engine's (spec) or plain AR; or
        ("flush", F): the planner's draft-context flush (:meth:`_flush_step`; not a planner mode, one graph
        per B whatever the sampling settings). A planner AR step (spec) defers its append iff
        ``defer_ar_append`` was set when its runner was made (part of the graph's key, as a tree step's
        :meth:`chain_first`).
        Building a graph resets the slots (idle, empty): build every runner before admitting rows."""
        slots, (kv, draft_cache) = self._slots_for(B), self._cache_view(B)
        mode = mode or (self.mode if spec else ("ar", 1))
        defer = spec and mode[0] == "ar" and self.budget == "auto" and self.defer_ar_append
        # a tree step's graph holds its tree rule (chain first or best first: tree_chain_first may change between calls)
        key = (B, spec, mode, *params.step_key, defer, self.chain_first(params) if mode[0] == "tree" else None)
        if mode[0] != "flush":
            # the LM heads this step runs: target over B·T rows, draft over B·(verify_size - 1)
            draft_rows = B * ((mode[1] if mode[0] == "chain" else self.verify_size) - 1)  # a chain's W - 1 slots
            self._tune_lm_head([B * mode[1]], draft_rows if mode[0] != "ar" else None)
        if mode[0] == "flush":
            flush_cache = self.draft_cache.view(B, lengths=slots.pend_lengths)
            fn = lambda: self._flush_step(slots, flush_cache)
            key = (B, mode)
        elif mode[0] == "ar":
            fn = lambda: self._ar_step(slots, kv, params, draft_cache if spec else None, defer)
        else:
            fn = lambda: self._spec_step(slots, kv, draft_cache, params, mode)
        if not self.cuda_graphs:
            return fn
        if key not in self._graphs:
            owner = self.slot_owner or []
            if any(o is not None for o in owner[:B]):
                # the warm-up below runs the step on emptied slots: mid-decode it would overwrite the live
                # rows' state and KV cache (every runner of a decode is made before its first admission)
                raise RuntimeError(f"CUDA graph for step {key} requested while requests are decoding (slots "
                                   f"{[b for b, o in enumerate(owner[:B]) if o is not None]}); make every runner "
                                   "before admitting rows (a planner mode added to plan_modes after its cost table "
                                   "was measured?)")
            slots.done.fill_(1)  # warm-up and capture on idle slots: commits nothing, lengths stay
            slots.lengths.zero_()
            if slots.pend_count is not None:  # nothing pending: the flush's warm-up writes the scratch slot
                slots.pend_count.zero_()
            side = self._warm_up(fn)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=side):
                    fn()
            except RuntimeError as e:
                if not self.target.args.hybrid:
                    raise
                # fla-core's kernels may sync or allocate on the host in a capture: run hybrid steps eagerly
                print(f"note: CUDA graph capture failed for a hybrid target ({str(e).splitlines()[0][:200]}); "
                      "CUDA graphs are off for this engine", flush=True)
                torch.cuda.synchronize()
                self.cuda_graphs = False
                slots.nonfinite.zero_()
                return fn
            slots.nonfinite.zero_()
            self._graphs[key] = graph
        graph = self._graphs[key]

        def replay(engine=self):  # the graph writes into this engine's caches: the runner keeps it alive
            graph.replay()

        return replay

    def _warm_up(self, fn) -> torch.cuda.Stream:
        """Run ``fn`` twice on the engine's capture stream (compiles the Triton kernels, warms cuBLAS and SDPA
        for its shapes), ordered after the current stream's work and before what follows; returns the stream,
        on which the caller captures ``fn``'s graph."""
        if self._capture_stream is None:
            # the engine's own capture stream: torch keys cuBLAS workspaces by stream, and recent
            # versions free a stream's workspace when any graph captured on it is destroyed
            # (pytorch#193402): on torch's shared default capture stream, another library's graph
            # could take the workspace our graphs replay
            self._capture_stream = torch.cuda.Stream()
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        return side

    def planner_modes(self, params: SamplingParams) -> list[tuple[str, int]]:
        """The modes the planner chooses from in a run with ``params``: ``plan_modes`` less the tree that is the chain
        at a tree step's price. A chain-first tree (:meth:`chain_first`: at T > 0, or with ``force_accept``) of
        ``verify_size`` nodes holds the chain's drafted tokens and nothing else, so it commits what the chain commits
        (a smaller one is a shorter chain, a mode of its own, and stays). Kept, it also took every probe from the
        tree of 32 (the planner probes the cheapest plausible mode, ``infer.planner`` rule 3; measured: docs/status.md,
        "The planner points", results/verify-h100.json). With drafter-invariant sampling (``SamplingParams.invariant``
        at T > 0) the trees are all left out: invariant verification checks the chain only; so they are at draft temperature 0 and
        T > 0, where the draft's distribution is one-hot and every node off the chain is padding (the fixed tree mode
        refuses it: ``check_tree_draft_temperature``)."""
        one_hot = params.draft_temperature == 0 and not params.greedy
        if params.invariant_sampling or one_hot:  # the chain only: invariant verification, or a one-hot draft
            return [m for m in self.plan_modes if m[0] != "tree"]
        if not self.chain_first(params):
            return list(self.plan_modes)
        return [m for m in self.plan_modes if m != ("tree", self.verify_size)]

    def _plan_key(self, B: int, params: SamplingParams) -> tuple:
        """The planner's cost-table key: batch size, sampling settings, ``defer_ar_append``, this run's planner modes
        (:meth:`planner_modes`: ``plan_modes`` and whether the trees keep the chain first)."""
        return (B, *params.step_key, self.defer_ar_append, tuple(self.planner_modes(params)))

    def _step_costs(self, B: int, params: SamplingParams) -> dict:
        """Milliseconds of one step of every planner mode of a run with ``params`` (:meth:`planner_modes`) at batch B
        (median of 5 after warm-up and graph capture, idle rows), measured once per :meth:`_plan_key` on this device.
        The AR mode is the planner's AR step as the loop runs it: with ``defer_ar_append`` the step that
        leaves its features pending; the flush (not a mode) is not in the table."""
        key = self._plan_key(B, params)
        if key not in self._costs:
            s, costs = self._slots_for(B), {}
            sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
            for mode in self.planner_modes(params):
                run = self._runner(B, params, True, mode)
                s.done.fill_(1)
                times = []
                for _ in range(7):
                    sync()
                    t = time.perf_counter()
                    run()
                    sync()
                    times.append(time.perf_counter() - t)
                costs[mode] = sorted(times[2:])[2] * 1e3
            s.nonfinite.zero_()
            self._costs[key] = costs
        return self._costs[key]

    # -- prefill / admission ---------------------------------------------------------------------
    def _admit(self, s: _Slots, items: list[tuple[int, list[int]]], params: SamplingParams, spec: bool, kv,
               draft_cache, seeds: list[int], defer: bool = False):
        """Prefill prompts into batch slots in one packed target pass (``items`` = [(slot, prompt ids)],
        ``seeds`` one request seed each), sample each first token (output position 0) and, with the
        draft, write the prompts' context K/V, or with ``defer`` (the planner's, :meth:`generate`) keep the
        prompts' target features in ``s.ctx_pending`` and count their positions in the slots' lengths, for
        :meth:`_write_deferred` to write before the first speculative step that reads them."""
        for _, prompt in items:  # the cache holds max_seq + block_size + 1 rows: a last block past max_seq fits
            if len(prompt) + params.max_new_tokens > self.max_seq:
                raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} exceeds "
                                 f"the engine context of {self.max_seq} positions")
        if params.max_new_tokens > self.max_new_cap:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} exceeds the engine cap {self.max_new_cap}")
        dev = self.device
        slots = [b for b, _ in items]
        lens = [len(x) for _, x in items]
        # the prompts, slots, seeds and lengths in one host-to-device copy that does not wait for the step in flight
        # (infer.model.to_device): the admission queues behind it, its host work overlapping the device's
        n, N = len(items), sum(lens)
        host = infer_model.to_device([t for _, prompt in items for t in prompt] + slots + list(seeds) + lens,
                                     torch.long, dev)
        ids = list(host[:N].split(lens))
        idx, seeds_d, lengths = host[N : N + n], host[N + n : N + 2 * n], host[N + 2 * n :].to(torch.int32)
        appended = False  # the draft-context K/V already written (inside the bucketed prefill)
        if self.prefill_buckets and (len(items) <= self.PREFILL_BUCKETS_MAX_PROMPTS or self.exact):
            # one padded pass per prompt (a CUDA graph per length bucket); many prompts: one packed pass below
            write = spec and not defer
            outs = [self._prefill_bucketed(x, b, kv, spec, draft_cache if write else None) for x, b in zip(ids, slots)]
            logits, appended = torch.cat([o[0] for o in outs]), write
            feats = torch.cat([o[1] for o in outs]) if spec and defer else None
        elif self.exact:  # one pass per prompt: its prefill must not depend on the prompts admitted with it
            outs = [self.target.prefill_packed([x], [b], kv, want_features=spec) for x, b in zip(ids, slots)]
            logits = torch.cat([o[0] for o in outs])
            feats = torch.cat([o[1] for o in outs]) if outs[0][1] is not None else None
        else:
            logits, feats = self.target.prefill_packed(ids, slots, kv, want_features=spec)  # [n, V], [ΣP, k·H]
        s.nonfinite[0] |= ~torch.isfinite(logits).all()
        s.seeds[idx] = seeds_d.to(s.seeds.dtype)
        if params.greedy:
            first = logits.argmax(-1)
        else:
            probs, ids = logits_to_probs(logits.float(), params.temperature, params.top_p, params.top_k, with_ids=True,
                                         impl=self.impl)
            first = sample(probs, s.seeds[idx], rng.STREAM_TARGET, torch.zeros(len(items), dtype=torch.long, device=dev),
                           ids, impl=self.impl)
        s.anchor[idx] = first
        if not appended:  # (the bucketed prefill set the draft-context lengths it wrote)
            s.lengths[idx] = 0 if spec and not defer else lengths
        s.out_tokens[idx, 0] = first
        s.out_len[idx] = 1
        s.max_new[idx] = params.max_new_tokens
        s.done[idx] = (torch.isin(first, self.eos) | (params.max_new_tokens <= 1)).to(torch.int32)
        s.hist[idx] = 0
        if spec:  # the prompts' context K/V from the packed features [Σ P, k·H]; lengths become P
            # a refilled slot's deferred prompt is its finished request's: never written (_write_deferred)
            for entry in s.ctx_pending:
                entry.keep = [k and b not in slots for k, b in zip(entry.keep, entry.slots)]
            s.ctx_pending = [e for e in s.ctx_pending if any(e.keep)]
            if defer:
                s.ctx_pending.append(_DeferredPrompts(feats, lengths, idx, [True] * n, slots))
            elif not appended:
                draft_cache.append_packed(feats, lengths, idx, impl=self.impl)
            if s.pend_count is not None:
                # the planner's deferred AR appends (_ar_step): an admitted slot's pending features are its
                # finished request's, and a later flush would write them at lengths - pend_count, over the
                # new prompt's context: drop them here (no flush before a refill: the rows still decoding
                # keep theirs for the next flush; this also clears what a previous generate left pending)
                s.pend_count[idx] = 0

    def _write_deferred(self, s: _Slots, draft_cache: DraftCache) -> None:
        """Write the deferred prompt contexts (``s.ctx_pending``, :meth:`_admit` with ``defer``) in one packed
        call as their rows' first positions (``append_packed`` with ``prefix``: the positions of the AR steps that
        followed, written or pending, stay); a prompt whose request has finished since goes to the scratch slot.
        ~30 launches whatever the number of prompts, no host sync."""
        entries, s.ctx_pending = s.ctx_pending, []
        keep = [k for e in entries for k in e.keep]
        if not any(keep):
            return
        draft_cache.append_packed(torch.cat([e.features for e in entries]), torch.cat([e.counts for e in entries]),
                                  torch.cat([e.rows for e in entries]), impl=self.impl, prefix=True,
                                  keep=infer_model.to_device(keep, torch.bool, self.device))

    def _prefill_bucketed(self, x: torch.Tensor, slot: int, kv: KVCache, want_features: bool,
                          draft_cache: DraftCache | None = None):
        """Prefill prompt ``x [P]`` (int64, on the device) into batch slot ``slot`` through
        :meth:`EngineTarget.prefill_static` at its length bucket: a replay of the bucket's CUDA graph (captured
        here at the bucket's first prompt, on this slot, which is being admitted: the capture's warm-up writes
        only its cache rows), or the same call eagerly without CUDA graphs. Returns logits ``[1, V]`` and
        features ``[P, k·H]`` (or None), copied out of the graph's static outputs. ``kv`` (a view of the
        first slots) shares the engine cache's storage; the graph runs on the whole cache, so without the
        draft context one graph per bucket serves every slot and batch size. A prompt longer than ``infer.model.PREFILL_BUCKET_MAX`` takes
        the unpadded pass (:meth:`EngineTarget.prefill_packed`) instead.

        ``draft_cache`` (with ``want_features``; a view of the first B slots whose lengths are the slots'): the
        prompt's draft-context K/V are written in the same pass (the slot's length set to 0, then the append of
        the first P feature rows, the padding's rows going to the scratch slot), inside the graph, and the
        features are not returned (None). One graph per bucket and batch size B then: the graph holds the
        B slots' length tensor. The eager append of a single admitted prompt is ~30 launches and costs
        1.5-2.5 ms of host time on SmolLM2 (results/admit-h200.json), about what the graphed target prefill
        takes."""
        P = int(x.shape[0])
        dev = self.device
        if P > infer_model.PREFILL_BUCKET_MAX:  # beyond the buckets: the unpadded pass, eagerly
            logits, feats = self.target.prefill_packed([x], [slot], kv, want_features=want_features)
            if draft_cache is not None:
                count_slot = infer_model.to_device([P, slot], torch.long, dev)
                self._write_context(draft_cache, feats, count_slot[:1], count_slot[1:])
                feats = None
            return logits, feats
        kv = self.cache
        Pb = infer_model.prefill_bucket(P, kv.seq)
        key = (Pb, want_features, None if draft_cache is None else int(draft_cache.lengths.shape[0]))
        entry = self._prefill_graphs.get(key)
        if entry is None:
            inputs = (torch.zeros(Pb, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                      torch.zeros(1, dtype=torch.long, device=dev))

            def fn(dc=draft_cache):
                logits, feats = self.target.prefill_static(*inputs, kv, want_features)
                if dc is not None:
                    self._write_context(dc, feats, inputs[2] + 1, inputs[1])
                    feats = None
                return logits, feats

            graph = None
            if self.cuda_graphs:
                inputs[1].fill_(slot)
                inputs[2].fill_(P - 1)
                side = self._warm_up(fn)
                if self._prefill_pool is None:
                    # one memory pool for all buckets: replays never overlap (one stream) and each replay's
                    # outputs are copied out before the next, so the graphs may share their scratch memory
                    self._prefill_pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._prefill_pool, stream=side):
                    outputs = fn()
            else:
                outputs = None
            entry = self._prefill_graphs[key] = (graph, inputs, outputs, fn)
        graph, (tok, slot_buf, last), outputs, fn = entry
        tok[:P] = x
        tok[P:] = 0  # padding: any valid id
        slot_buf.fill_(slot)
        last.fill_(P - 1)
        if graph is not None:
            graph.replay()
            logits, feats = outputs
        else:
            logits, feats = fn()
        return logits.clone(), None if feats is None else feats[:P].clone()

    def _write_context(self, draft_cache: DraftCache, feats: torch.Tensor, count: torch.Tensor, slot: torch.Tensor):
        """A prompt's draft context from scratch: slot ``slot [1]``'s length set to 0, then the first ``count [1]``
        rows of ``feats [P, k·H]`` appended (no host sync: graph-safe, and rerunnable for a graph's warm-up)."""
        draft_cache.lengths.index_fill_(0, slot, 0)
        draft_cache.append(feats[None], count, rows=slot, impl=self.impl)

    @torch.inference_mode()
    def capture_prefill(self, batch: int, max_prompt: int, use_draft: bool = True) -> int:
        """Make now the bucketed-prefill graphs that admissions of prompts of up to ``max_prompt`` tokens into a
        batch of ``batch`` slots would make at their bucket's first prompt; returns how many were made (0 without
        ``prefill_buckets``, or when all exist; without CUDA graphs the entries hold the static inputs of the
        eager pass, each run once).

        A graph is made on first use, mid-decode (its warm-up runs the prefill twice eagerly, then captures:
        about three eager prefills, 40-50 ms on SmolLM2), so a timed run that meets a new length bucket pays for it:
        MT-Bench's second turn holds the model's own first answer, whose length changes with the configuration
        (issue 16: the planner's MT-Bench admissions at concurrency 8, T = 0, took 0.154 s of device time against
        the chain's 0.064 s; results/verify-h200.json, ``planner_drain_2d9218a``, ``per_task``). ``infer.bench`` calls this for every configuration before each
        task, at the task's batch size, with ``--max-prompt-tokens``; a server would at start-up. Each graph is made on slot 0 (its
        target KV and draft context are overwritten by the next admission), so no request may be decoding.

        Args:
            batch: the batch size (slots) of the ``generate`` calls to come (``min(concurrency, prompts)``): with
                the draft context the graph holds the slots' length tensor, one graph per batch size.
            max_prompt: the longest prompt to come, in tokens (capped at ``max_seq - 1`` and
                ``infer.model.PREFILL_BUCKET_MAX``: longer prompts take the unpadded pass).
            use_draft: the calls' ``use_draft`` (with a draft: the graphs that also write the draft context).
        Raises:
            ValueError: ``batch`` not an int in 1..max_batch, or ``max_prompt`` not an int >= 1.
            RuntimeError: a request is decoding (a ``generate`` in progress).
        """
        if not (isinstance(batch, int) and isinstance(max_prompt, int)) or not 1 <= batch <= self.max_batch \
                or max_prompt < 1:
            raise ValueError(f"capture_prefill: batch={batch} must be in 1..{self.max_batch} and max_prompt={max_prompt} "
                             ">= 1")
        if any(o is not None for o in (self.slot_owner or [])):
            raise RuntimeError("capture_prefill: requests are decoding; call it between generate calls")
        if not self.prefill_buckets:
            return 0
        spec = use_draft and self.draft is not None
        kv, draft_cache = self._cache_view(batch)
        cap = self.cache.seq
        top = min(max_prompt, self.max_seq - 1, infer_model.PREFILL_BUCKET_MAX)  # a prompt leaves room for a token
        made = 0
        # the planner's deferring admissions (plan_defer_prompt) take the graphs that keep the features instead
        caches = [draft_cache if spec else None] + ([None] if spec and self.budget == "auto" and self.plan_defer_prompt
                                                    else [])
        for Pb in sorted({infer_model.prefill_bucket(p, cap) for p in range(1, top + 1)}):
            for dc in caches:
                if (Pb, spec, None if dc is None else batch) in self._prefill_graphs:
                    continue
                self._prefill_bucketed(torch.zeros(Pb, dtype=torch.long, device=self.device), 0, kv, spec, dc)
                made += 1
        return made

    # -- the decode loops ------------------------------------------------------------------------
    def _flags_async(self, s: _Slots, buf: torch.Tensor):
        """Enqueue a copy of ``done [B]`` + ``nonfinite [2]`` (``state[:B + 2]``: one copy, no kernel) into the host
        buffer ``buf [B + 2]`` int32 (pinned on a GPU); returns the CUDA event that marks it complete (None on the
        CPU: already done)."""
        buf.copy_(s.state[: s.B + 2], non_blocking=True)
        return self._event()

    def _event(self, timing: bool = False):
        """A CUDA event recorded on the current stream after the work enqueued so far (None on the CPU,
        where that work is already done); ``timing``: one that ``elapsed_time`` can read (the planner loop, ``profile_device``)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record()
        return event

    @staticmethod
    def _check_finite(flags: list[int], B: int) -> None:
        """Raise :func:`nonfinite_error` if the ``nonfinite`` flags (``flags[B:]``: target, draft) are set."""
        for who, bad in zip(("target", "draft"), flags[B:]):
            if bad:
                raise nonfinite_error(who)

    @staticmethod
    def _refill_now(queue, free: list[int], refill: int, B: int) -> bool:
        """Whether to admit queued prompts into the ``free`` slots now: at least ``refill`` of them are free
        (or as many as are queued), or the batch is empty."""
        return bool(queue) and bool(free) and (len(free) >= min(refill, len(queue)) or len(free) == B)

    def _release_finished(self, s: _Slots, flags: list[int], owner: list, width: int, pending: list) -> list[int]:
        """Harvest the rows whose ``done`` flag is set and that still have an owner (:meth:`_harvest_async`, appended
        to ``pending``), clear their ``owner`` entries, and return the free slots (every slot without an owner)."""
        finished = [b for b in range(len(owner)) if flags[b] and owner[b] is not None]
        if finished:
            pending.append(self._harvest_async(s, finished, [owner[b] for b in finished], width))
            for b in finished:
                owner[b] = None
        return [b for b in range(len(owner)) if owner[b] is None]

    def _harvest_async(self, s: _Slots, rows: list[int], owners: list[int], width: int):
        """Enqueue the copy of finished rows (their ``out_len``, ``hist[:, :width + 1]`` and ``out_tokens``)
        into one pinned host tensor ``[n, 2 + width + max_new]`` int64: only these rows cross the bus, and
        the host waits for them later (:meth:`_harvest_finish`), when the step launched after them runs.
        Stream order keeps it correct: the copy is enqueued before any refill of these slots, and a done
        row is not changed by the steps in between."""
        cuda = self.device.type == "cuda"
        idx = infer_model.to_device(rows, torch.long, self.device)
        packed = torch.cat([s.out_len.index_select(0, idx)[:, None].long(),
                            s.hist.index_select(0, idx)[:, : width + 1].long(),
                            s.out_tokens.index_select(0, idx)], dim=1)
        host = torch.empty(packed.shape, dtype=torch.long, pin_memory=cuda)
        host.copy_(packed, non_blocking=True)
        return owners, host, self._event()

    def _harvest_finish(self, pending: list, width: int, results, reasons, stats) -> None:
        """Wait for the harvests of :meth:`_harvest_async` and write each prompt's tokens, finish reason
        ("stop" if its last token is an EOS, else "length") and acceptance histogram."""
        for owners, host, event in pending:
            if event is not None:
                event.synchronize()
            for i, row in zip(owners, host.tolist()):
                results[i] = row[2 + width : 2 + width + row[0]]
                reasons[i] = "stop" if results[i][-1] in self.eos_set else "length"
                stats[i] = AcceptStats(width, row[1 : 2 + width])
        pending.clear()

    def _decode_pipelined(self, s: _Slots, B: int, width: int, step, owner, queue, refill, admit, results,
                          reasons, stats) -> int:
        """The decode loop without a planner; returns the steps run.

        The host stays one step ahead of the device (issue 11): it launches step k, then reads the flags
        from before step k (copied to pinned memory behind step k - 1) while the device runs step k, so
        the host's bookkeeping and the step's launch overlap the device instead of adding to it. A row
        that finished in step k - 1 is idle (done: it commits nothing) in step k, and its slot is refilled
        before step k + 1: one idle step per finished request. Finished rows are copied out asynchronously
        (:meth:`_harvest_async`). The order of admissions shifts by that step, which changes which prompts
        share a packed prefill, not any prompt's output in fp32 (tests/test_engine.py: refill); in bf16 a prompt's
        prefill attention is one varlen call when admitted with others and SDPA when alone, so greedy output can
        part at near-ties, as with any change of concurrency."""
        cuda, prof = self.device.type == "cuda", self.loop_profile
        bufs = [torch.empty(B + 2, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        cur = 0
        snap = (bufs[cur], self._flags_async(s, bufs[cur]))  # the flags before the next step
        pending: list = []  # harvests in flight
        n_steps = 0
        marks = [] if cuda and self.profile_device else None  # (event before, event after) per step
        while True:
            t0 = time.perf_counter()
            before = self._event(timing=True) if marks is not None else None
            step()
            if marks is not None:
                marks.append((before, self._event(timing=True)))
            n_steps += 1
            cur ^= 1
            nxt = (bufs[cur], self._flags_async(s, bufs[cur]))  # the flags after this step
            t1 = time.perf_counter()
            if snap[1] is not None:
                snap[1].synchronize()
            t2 = time.perf_counter()
            flags = snap[0].tolist()
            self._harvest_finish(pending, width, results, reasons, stats)
            self._check_finite(flags, B)
            free = self._release_finished(s, flags, owner, width, pending)
            t3 = time.perf_counter()
            if self._refill_now(queue, free, refill, B):
                admit(free)
                # the flags after this step and the refill (same buffer as nxt: stream order, last wins);
                # a refilled row may already be done (EOS first): seen at the next read
                nxt = (bufs[cur], self._flags_async(s, bufs[cur]))
            snap = nxt
            prof["launch_s"] += t1 - t0
            prof["wait_s"] += t2 - t1
            prof["host_s"] += t3 - t2
            if not any(o is not None for o in owner):
                break
        self._harvest_finish(pending, width, results, reasons, stats)
        if marks:
            marks[-1][1].synchronize()
            prof["device_step_s"] = sum(a.elapsed_time(b) for a, b in marks) / 1e3
            prof["device_loop_s"] = marks[0][0].elapsed_time(marks[-1][1]) / 1e3
        return n_steps

    def _tree_pairs(self, vals: list[int], B: int, rows: list[int], done: list[int], mode, table) -> tuple[list, list]:
        """What a tree step tells the planner besides its own tokens (:meth:`_decode_planned`, "Paired observations").

        Args:
            vals: the step's state snapshot as a list (``_Slots.state``: done, nonfinite, out_len, conf, chain_acc
                ``[3B + 2 : 4B + 2]``, inner_acc column j at ``[(4 + j)B + 2 : (5 + j)B + 2]``).
            B: slots; rows: the slots observed in the step; done: their committed tokens (same order).
            mode: the tree mode run, ``("tree", N)``; table: the planner's modes.
        Returns:
            ``(paired, chain_done)``: ``paired`` the ``(mode, mean committed tokens per row)`` to give
            ``StepPlanner.observe_paired`` in this order, smallest first: every chain mode the tree covers
            (``min(K, N - 1) >= n - 1``; chain_acc + 1, capped by the chain's size and the tree's tokens), then
            every planner tree smaller than N in ``table`` (inner_acc + 1, capped by the tree's tokens);
            ``chain_done`` per row the chain-equivalent tokens of the step for the drain rule's statistics
            (chain_acc + 1 capped by the longest chain mode and the tree's tokens; empty without a chain mode).
        """
        acc = vals[3 * B + 2 : 4 * B + 2]
        chains = [m for m in self.plan_modes if m[0] == "chain" and m in table]
        paired = [(m, sum(min(acc[b] + 1, m[1], d) for b, d in zip(rows, done)) / len(rows)) for m in chains
                  if min(self.block_size - 1, mode[1] - 1) >= m[1] - 1]
        for j, n in enumerate(self.plan_trees):  # the planner trees inside the one run (columns in plan_trees order)
            if n < mode[1] and ("tree", n) in table:
                inner = vals[(4 + j) * B + 2 : (5 + j) * B + 2]
                paired.append((("tree", n), sum(min(inner[b] + 1, d) for b, d in zip(rows, done)) / len(rows)))
        cap = max((m[1] for m in chains), default=0)  # the longest chain mode: a tree step's chain-equivalent
        return paired, [min(acc[b] + 1, cap, d) for b, d in zip(rows, done)] if cap else []

    def _decode_planned(self, s: _Slots, B: int, width: int, planner: StepPlanner, params: SamplingParams,
                        owner, queue, refill, admit, results, reasons, stats, flush=None, plens=()) -> int:
        """The decode loop of the verify-budget planner; returns the steps run. ``plens``: each prompt's tokens, for
        the context tokens planner states ``"kv"`` and ``"rows_kv"`` take: the live requests' (prompt + committed
        tokens; a finished or idle row's attention reads no cache, :meth:`_attn_lengths`).

        Pipelined like :meth:`_decode_pipelined` (issue 16: the earlier loop read the flags after every step,
        one sync per step, and ran 0.67-0.84 × the fixed chain: the README): the host chooses the mode of step k and
        launches it, then reads the snapshot taken after step k - 1 (``done``, ``nonfinite``, ``out_len`` and ``conf`` in one pinned copy)
        while the device runs step k. So the planner observes step k - 1 after choosing step k: its
        choices are one step later than its observations, and :class:`~infer.planner.StepPlanner` keeps
        the unobserved choices in order.

        Observation of step j: the committed tokens (``out_len`` after j minus before j) averaged over the
        rows live before j and owned by the same request before and after it; its time is, on a GPU, the
        device time between the snapshots before and after j (CUDA timing events: step j's kernels plus any
        wait for the host to launch it, the time the step really costs whether the device or the host is
        the bottleneck) and, on the CPU, where a step runs inside its launch call, the host time from
        launching j to launching j + 1; a step whose interval holds a prefill (a refill) is observed
        without a time.
        Confidence: ``conf`` (``dspine.ops.plan_stats.chain_confidence``, written by the speculative steps on the device)
        of the observed step, its mean over the rows observed, is passed to the next choice as the
        predicted committed tokens of every speculative mode (``infer.planner``, "Calibration"): the
        draft's view of a passage two steps old. After an AR step (no draft ran), a chain narrower than
        ``verify_size`` (its confidence covers its own slots only) or with no such row the planner gets none; with
        ``plan_confidence = "greedy"`` (the default) it gets none at T > 0 either.
        Paired observations: after a tree step, what the chain would have committed (``chain_acc``, the
        chain nodes on the accepted path, + 1, capped by the tree's committed tokens), per chain mode the
        tree covers (``infer.planner``, "Paired observations"); a lower bound where a best-first tree (T = 0)
        dropped the chain's deeper nodes. Then, per planner tree smaller than the one run, what it would have
        committed (``inner_acc`` + 1, capped alike): its nodes are the run tree's first by rank, so its path is the
        run path's prefix inside it (``dspine.tree.inner_accepted``), smallest first. After a chain step, per
        narrower planner chain of n (``plan_chains``), smallest first: min(committed, n) per row (its slots are the
        run chain's first n, tested alike; EOS and max_new cut both alike): exact up to rounding, since the narrower
        chain's draft head and verify run over other row counts, so a near-tie can part.
        Drain (``plan_drain``): per slot, the committed tokens, count and sum of squares of its request's chain
        steps, a narrower chain's included (its tokens cut at its width; not under ``plan_drain_model="own"``, which
        measures a request against the full chain's estimate), and of the chain parts of its tree steps,
        reset when the slot is refilled (a finished request's
        stay while its slot idles); once the queue is empty, the planner gets them with each request's
        remaining tokens every ``PLAN_DRAIN_EVERY`` choices (``infer.planner``, "Drain"). The rule compares requests
        by their acceptance relative to the batch's pooled one, which the same steps cut alike (requests admitted
        together run the same steps; with refills the mix of widths differs between requests, and the spread the
        planner carries to its next call is learned in these cut units); without the narrower
        chains' steps a batch running only those (all its prompts admitted at once, so the rule in force from its
        first step) never had a request's statistic and judged every speculative mode on the prior spread of its
        slowest request (AR at most steps where the fixed chain of 4 beat AR: docs/status.md, "769 of 915").

        Deferred draft context (``flush``: the runner of :meth:`_flush_step`, None when
        ``defer_ar_append`` is off): the AR steps leave their target features pending (``pend_feats``,
        ``pend_count``: :meth:`_ar_step`) instead of appending them, so an AR step is the plain AR step
        plus its features and one scatter. The host counts the AR steps launched since the last flush and
        launches the flush (stream-ordered, no sync) just before the next step when that step is
        speculative (its draft reads the context) or when F = ``ar_defer`` AR steps ran (so no row has more
        than F pending: the flush goes in right after the F-th, before the step that would overflow; at
        most a refill's prefill in between, which leaves the other rows' pending features valid). An
        admission needs no flush:
        ``_admit`` drops the pending features of the slots it refills (their requests are finished), and
        the rows still decoding keep theirs. Rows left pending when the loop ends are dropped at the next
        admission. The flush is launched after the launch time of the step it precedes is taken and after
        the snapshot that closes the step before, so its time is in the measured interval of the step after
        it (GPU and CPU alike): a speculative step after an AR stretch, or the (F + 1)-th AR step, carries
        the cost of one flush; the start-up table (:meth:`_step_costs`) times the deferring AR step
        without it. Deferred prompts (``s.ctx_pending``: admissions while AR is the planner's best mode,
        :meth:`_admit` with ``defer``) are written by :meth:`_write_deferred` before the first speculative step
        after them, after the flush (one packed append of the prompts' rows, like an admission's), and that step
        is timed from the end of the write (a CUDA event recorded after it; on the CPU the host time after it), the
        flush before it left out with it: the write is an admission's work, up to ten steps' time, and charged to
        the step it once set a mode's measured ÷ table ratio for good (docs/status.md, "12.5 ms against the table's").
        A drain refresh (``infer.planner.drain_tokens``, host work in the choice of a step) is no mode's cost:
        where it outlasts the step in flight the device waits for the launch, and on CUDA that wait, up to the
        host time from the loop's top to the launch, is taken out of the step's time (the idle between the previous
        snapshot and an event recorded at the launch); the CPU times every step from its launch to the next step's
        choice. The other steps keep the loop's ordinary host time; a step chosen with a refresh is priced below
        them by at most the choice's own host time (tens of microseconds; the cap counts it with the refresh's;
        measured: docs/status.md, "The drain refresh's host time")."""
        if self.plan_confidence not in ("greedy", "always", "never"):
            raise ValueError(f"Engine.plan_confidence={self.plan_confidence!r}: use 'greedy', 'always' or 'never'")
        cuda, prof = self.device.type == "cuda", self.loop_profile
        # _Slots.state: done [B], nonfinite [2], out_len [B], conf [B] (fp32 bits), chain_acc [B], inner_acc [S, B],
        # all int32; a tree step's paired observations come from it (_tree_pairs)
        bufs = [torch.empty(s.state.numel(), dtype=torch.int32, pin_memory=cuda) for _ in range(2)]

        def snapshot(buf):
            buf.copy_(s.state, non_blocking=True)  # one copy, no kernel
            return self._event(timing=True)  # its time closes the step before it

        draft_cache = self._cache_view(B)[1]
        cur = 0
        # (buffer, event, slot owners when taken, a prefill ran since the previous snapshot)
        snap = (bufs[cur], snapshot(bufs[cur]), list(owner), True)
        base = None  # the last snapshot read: (out_len, live, owners, its CUDA event)
        # (mode, host time at launch, (CUDA event, host time) after a deferred prompts' write or None, host time at the
        # loop's top before the step's choice, (CUDA event at the launch, host seconds from the loop's top to it) of a
        # step chosen with a drain refresh or None) of the steps not yet observed, oldest first
        launched: deque = deque()
        predicted = None
        pending: list = []  # harvests in flight
        n_steps = 0
        ar_pending = 0  # AR steps launched since the last flush: no row has more features pending
        # each mode's step fetched once (graph replay or eager step): _runner builds the key, the slot and
        # cache views and checks the LM-head choices on every call, ~70 µs of host time a step (SmolLM2, CPU
        # host), which a host-bound step at concurrency 1 pays in full; _decode_pipelined fetches its step once
        runners: dict = {}
        # per slot, its request's chain(-equivalent) committed tokens and steps: chain steps, and the chain nodes of
        # tree steps (the drain rule, infer.planner "Drain"); reset when the slot is refilled
        row_tokens, row_steps, row_sq = [0] * B, [0] * B, [0] * B
        drain_age = 0  # choices since the queue ran dry: the batch goes to the planner every PLAN_DRAIN_EVERY
        while True:
            t0 = time.perf_counter()
            drain = None
            if self.plan_drain and not queue and base is not None and drain_age % self.PLAN_DRAIN_EVERY == 0:
                # the batch's requests: (tokens it may still commit, chain tokens, steps, tokens²); 0 to commit once
                # finished (its slot keeps its counts until refilled); a slot refilled after the snapshot read
                # last has committed only its first token. One entry per slot, in slot order at every refresh (an
                # idle slot's are zeros, which no rule counts): drain model "persist" matches them by position
                drain = []
                for b in range(B):
                    fresh = base[2][b] != owner[b]  # refilled after the snapshot
                    live = owner[b] is not None and (fresh or base[1][b])
                    left = params.max_new_tokens - (1 if fresh else base[0][b]) if live else 0
                    drain.append((left, row_tokens[b], row_steps[b], row_sq[b]))
            kv = None
            if planner.state != "steps":  # a slot refilled after the snapshot has committed its first token
                kv = sum(plens[o] + (base[0][b] if base is not None and base[2][b] == o else 1)
                         for b, o in enumerate(owner) if o is not None)
            mode = planner.choose(predicted, drain, kv)
            if drain is not None or drain_age:  # counting from the first drain given
                drain_age += 1
            t_launch = time.perf_counter()
            # a drain refresh's host work (choose() mapping the batch) can outlast the step in flight: the device's
            # wait for this launch, up to the refresh's host time, is no mode's cost and is taken out of the step's
            # time (an event at the launch, before the flush, whose time stays in the step it precedes)
            refresh = (self._event(timing=True), t_launch - t0) if drain is not None else None
            start = None
            if ar_pending and (mode[0] != "ar" or ar_pending == s.pend_max):
                flush()  # the draft reads its context in this step, or F are pending
                ar_pending = 0
                prof["flushes"] += 1
            if s.ctx_pending and mode[0] != "ar":  # the draft reads the deferred prompts' context in this step
                self._write_deferred(s, draft_cache)
                # timed from after the write (its own, admission-sized work), the flush before it left out with it
                start = (self._event(timing=True), time.perf_counter())
            launched.append((mode, t_launch, start, t0, refresh))
            run = runners.get(mode)
            if run is None:
                run = runners[mode] = self._runner(B, params, True, mode)
            run()
            ar_pending += flush is not None and mode[0] == "ar"
            n_steps += 1
            cur ^= 1
            nxt = [bufs[cur], snapshot(bufs[cur]), list(owner), False]  # after this step
            t1 = time.perf_counter()
            if snap[1] is not None:
                snap[1].synchronize()
            t2 = time.perf_counter()
            vals = snap[0].tolist()
            flags, out_len = vals[:B + 2], vals[B + 2 : 2 * B + 2]
            self._harvest_finish(pending, width, results, reasons, stats)
            self._check_finite(flags, B)
            predicted = None
            if base is not None:  # observe the step between the previous snapshot and this one
                done_mode, t_launch, start, _, refresh = launched.popleft()
                rows = [b for b in range(B) if base[1][b] and base[2][b] is not None and base[2][b] == snap[2][b]]
                if rows:
                    ms = None
                    if self.plan_online and not snap[3]:  # no prefill in the interval
                        if cuda:
                            ms = (base[3] if start is None else start[0]).elapsed_time(snap[1])
                            if refresh is not None and start is None:  # the device idle while the host refreshed
                                ms -= min(max(base[3].elapsed_time(refresh[0]), 0.0), refresh[1] * 1e3)
                        else:
                            # to the next step's choice: its drain refresh (host work) is no mode's cost either
                            ms = (launched[0][3] - (t_launch if start is None else start[1])) * 1e3
                    done = [out_len[b] - base[0][b] for b in rows]  # committed tokens per observed row
                    kv = sum(plens[base[2][b]] + base[0][b] for b in rows) if planner.state != "steps" else None
                    planner.observe(done_mode, sum(done) / len(rows), ms, len(rows), kv)
                    if done_mode[0] != "ar":
                        conf = snap[0][2 * B + 2 : 3 * B + 2].view(torch.float32).tolist()  # (spec steps only)
                        c = sum(conf[b] for b in rows) / len(rows)
                        chain_done, narrow = done, done_mode[0] == "chain" and done_mode[1] < self.verify_size
                        if done_mode[0] == "tree":  # committed as the chain, capped by the tree's (EOS, max_new)
                            paired, chain_done = self._tree_pairs(vals, B, rows, done, done_mode, planner.table)
                        else:  # a chain's first n slots are the chain of n: what it committed, capped at n
                            paired = [(m, sum(min(d, m[1]) for d in done) / len(rows)) for m in planner.table
                                      if m[0] == "chain" and m[1] < done_mode[1]]
                            paired.sort(key=lambda m_x: m_x[0][1])  # smallest first (observe_paired's leads)
                            if narrow and self.plan_drain_model == "own":  # "own" reads them against the full chain
                                chain_done = []
                        for m, x in paired:
                            planner.observe_paired(m, x, len(rows))
                        for b, d in zip(rows, chain_done):
                            row_tokens[b] += d
                            row_steps[b] += 1
                            row_sq[b] += d * d
                        # a narrow chain's confidence covers its own slots only: not comparable, not given
                        if not narrow and (self.plan_confidence == "always"
                                           or (self.plan_confidence == "greedy" and params.greedy)):
                            predicted = {m: c for m in planner.table if m[0] != "ar"}
                else:
                    planner.skip()
            base = (out_len, [not f for f in flags[:B]], snap[2], snap[1])
            free = self._release_finished(s, flags, owner, width, pending)
            t3 = time.perf_counter()
            if self._refill_now(queue, free, refill, B):
                admit(free)
                for b in free:  # the refilled slots (a finished request's counts stay while its slot idles)
                    if owner[b] is not None:
                        row_tokens[b] = row_steps[b] = row_sq[b] = 0
                # the snapshot after this step and the refill (same buffer: stream order, last wins); its
                # interval holds the prefill, so the step it closes is observed without a time
                nxt = [bufs[cur], snapshot(bufs[cur]), list(owner), True]
            snap = tuple(nxt)
            prof["launch_s"] += t1 - t0
            prof["wait_s"] += t2 - t1
            prof["host_s"] += t3 - t2
            if not any(o is not None for o in owner):
                break
        self._harvest_finish(pending, width, results, reasons, stats)
        return n_steps

    # -- public ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, concurrency: int | None = None,
                 use_draft: bool = True, seeds: list[int] | None = None,
                 refill: int | None = None) -> GenerationResult:
        """Decode every prompt; at most ``concurrency`` (default: max_batch) at a time, slots refilled
        from the queue as rows finish. Output tokens include the EOS that ended a row.

        ``seeds``: one request seed per prompt (default ``request_seed(params.seed, i)``); a prompt's
        output depends only on its seed and tokens, not on the batch or the concurrency.

        ``refill``: free slots to wait for before admitting queued prompts in one packed prefill
        (default 1 up to 16 slots, else concurrency // 16). Waiting amortises the prefill's launches
        over many prompts (large-batch regeneration) at the cost of a few idle slots; with 1, a
        finished row is replaced before the next step (benchmarks at fixed concurrency).

        Raises:
            ValueError: no prompts, concurrency < 1, a prompt that does not fit the context, empty prompts,
                a bad ``seeds`` list, ``tree_chain_first=False`` at T > 0 or with ``force_accept``.
            FloatingPointError: non-finite target or draft logits (e.g. fp16 overflow, NaN weights),
                never a silent "τ = 1".
        """
        params.validate()
        # (the planner's tree modes stay: at draft temperature 0 they cost more than the chain for its τ, and it
        # stops choosing them)
        check_tree_draft_temperature(params, use_draft and self.draft is not None and self.mode[0] == "tree"
                                     and self.budget != "auto")
        if self.force_accept is not None and params.invariant_sampling and use_draft:
            raise ValueError("force_accept with invariant sampling: the forced acceptance ignores the target's draws, "
                             "so the text would not be the plain decode's")
        if use_draft and self.draft is not None and (self.mode[0] == "tree" or self.budget == "auto"):
            self.chain_first(params)  # tree_chain_first=False at T > 0 raises here, before any work
        self.slot_owner = None  # no request decoding until this call admits
        if not prompts:
            raise ValueError("generate: no prompts")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"generate: concurrency {concurrency}: must be >= 1 (None: max_batch)")
        check_prompts(prompts)
        seeds = request_seeds(params, len(prompts), seeds, "cpu").tolist()
        spec = use_draft and self.draft is not None
        width = self.verify_size if spec else 1  # committed tokens per step: 1 .. width
        B = min(concurrency or self.max_batch, self.max_batch, len(prompts))
        refill = max(1, refill if refill is not None else (1 if B <= 16 else B // 16))
        s = self._slots_for(B)
        kv, draft_cache = self._cache_view(B)
        step = self._runner(B, params, spec)
        if spec and self.budget == "auto" and self.plan_drain_model not in DRAIN_MODELS:
            raise ValueError(f"Engine.plan_drain_model={self.plan_drain_model!r}: use "
                             f"{' or '.join(map(repr, DRAIN_MODELS))}")
        planner = (StepPlanner(self._step_costs(B, params), drain_model=self.plan_drain_model,
                               conf_slope=self.plan_conf_slope, state=self.plan_state)
                   if spec and self.budget == "auto" else None)
        key = self._plan_key(B, params)
        if planner is not None and self.plan_schedule:
            modes = self.planner_modes(params)
            off = [m for m in self.plan_schedule if m not in modes]
            if off:
                raise ValueError(f"Engine.plan_schedule has modes {off} outside this run's planner modes {modes} "
                                 "(Engine.planner_modes: plan_modes less the chain-first tree of verify_size nodes, "
                                 "or less every tree with invariant sampling)")
            planner.schedule = list(self.plan_schedule)
        # a JSONL file: one line per planned call (diagnosis); checked before the decode, not after its work
        plan_log = plan_log_path() if planner is not None else None
        if plan_log:
            planner.start_log()
        if planner is not None:  # what the previous generate at this key learned (infer.planner, "Across calls")
            if self.plan_online and key in self.plan_cost_memory:
                planner.load_cost_state(self.plan_cost_memory[key])
            if self.plan_memory and key in self.plan_token_memory:
                planner.load_token_state(self.plan_token_memory[key])
        flush = None  # the planner's draft-context flush, made (captured) before any row is admitted
        if planner is not None and self.defer_ar_append:
            flush = self._runner(B, params, True, ("flush", s.pend_max))
        t0 = time.perf_counter()
        prefill_s = 0.0
        self.loop_profile = dict.fromkeys(("launch_s", "wait_s", "host_s"), 0.0)
        if planner is not None:
            self.loop_profile["flushes"] = 0
        queue = deque(enumerate(prompts))
        owner: list[int | None] = [None] * B
        self.slot_owner = owner  # prompt index per slot (read by test oracles and debugging)
        results: list[list[int]] = [[] for _ in prompts]
        reasons = [""] * len(prompts)
        stats = [AcceptStats(width) for _ in prompts]
        s.done.fill_(1)
        s.nonfinite.zero_()
        s.ctx_pending = []  # a previous call's deferred prompts: its requests are over

        # CUDA events around each admission; admissions (prefill calls)
        events, admits = [], [0]

        def admit(free: list[int]):
            nonlocal prefill_s
            tp = time.perf_counter()
            items = []
            for b in free:
                if not queue:
                    break
                owner[b], prompt = queue.popleft()
                items.append((b, prompt))
            if items:
                admits[0] += 1
                if self.device.type == "cuda":  # no sync: the admission queues behind the step in flight
                    events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                    events[-1][0].record()
                # the planner's admissions while AR is its best mode defer the draft's prompt context
                defer = planner is not None and self.plan_defer_prompt and not planner.drafting_pays()
                self._admit(s, items, params, spec, kv, draft_cache, [seeds[owner[b]] for b, _ in items], defer)
                if self.device.type == "cuda":
                    events[-1][1].record()
            prefill_s += time.perf_counter() - tp

        try:
            admit(list(range(B)))
            if planner is None:
                n_steps = self._decode_pipelined(s, B, width, step, owner, queue, refill, admit, results, reasons,
                                                 stats)
            else:
                n_steps = self._decode_planned(s, B, width, planner, params, owner, queue, refill, admit, results,
                                               reasons, stats, flush, [len(p) for p in prompts])
        except BaseException:
            self.slot_owner = None  # no request decodes after a failed call (capture_prefill, _runner check it)
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.planner_report = planner.report() if planner is not None else None
        if planner is not None:
            if self.plan_online:
                self.plan_cost_memory[key] = planner.cost_state()
            if self.plan_memory:
                self.plan_token_memory[key] = planner.token_state()
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(r) for r in results)
        if planner is not None and planner.log is not None:
            device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            line = {"device": device, "batch": B, "prompts": len(prompts), "temperature": params.temperature,
                    "max_new_tokens": params.max_new_tokens, "steps": n_steps, "wall_s": round(elapsed, 4),
                    "tokens": n_tokens, "lengths": [len(r) for r in results],
                    **({"tag": self.plan_log_tag} if self.plan_log_tag is not None else {}), "log": planner.logged()}
            append_plan_record(plan_log, line)
        self.loop_profile.update(steps=n_steps, prefill_s=prefill_s, wall_s=elapsed, tokens=n_tokens, admit_device_s=sum(a.elapsed_time(b) for a, b in events) / 1e3, admits=admits[0])
        return GenerationResult(results, reasons, stats, elapsed, prefill_s, n_steps)


# -----------------------------------------------------------------------------------------------
# construction


def load_engine(target_path: str, gguf_file: str | None, draft_path: str | None, *, device="cuda",
                dtype=torch.bfloat16, impl: str | None = None, eos_token_ids=None,
                check_max_context: int | None = None, draft_vocab=None, **engine_kw):
    """Target + draft (after the ``dspine.check`` compatibility checks) -> :class:`Engine` (``engine_kw``: the
    keyword arguments of :class:`Engine`, its defaults; ``draft_vocab`` may also be the path of a
    ``dspine.draft_vocab`` file).

    Raises:
        ValueError: draft/target mismatch (every failed check listed), fp16 with a Qwen target, a draft
            vocabulary file that is not one or does not fit the target (its vocabulary size, or ids that name
            other tokens in the target's tokenizer: ``dspine.draft_vocab.check_tokens``; the message names the
            file).
        FileNotFoundError: no draft vocabulary file at the path.
    """
    impl = impl or ("triton" if torch.device(device).type == "cuda" else "torch")
    spec = TargetSpec.from_pretrained(target_path, gguf_file)
    draft_model = None
    layer_ids, last_layer_features = None, "post_norm"
    if draft_path:
        draft_model = load_draft(draft_path, device=device, dtype=dtype)
        assert_compatible(spec, draft_model.config, max_context=check_max_context)
        layer_ids, last_layer_features = draft_model.config.target_layer_ids, draft_model.config.last_layer_features
    check_target_dtype(dtype, spec.model_type)
    if isinstance(draft_vocab, (str, os.PathLike)):  # read (and checked) before the target's weights
        vocab_path = draft_vocab
        draft_vocab, meta = load_draft_vocab(vocab_path, spec.vocab_size)
        if meta.get("tokens_digest"):  # its ids must name the same tokens in the target's tokenizer
            from dspine.paths import load_tokenizer

            check_tokens(vocab_path, draft_vocab, meta, load_tokenizer(target_path, gguf_file))
    target = EngineTarget.from_pretrained(target_path, gguf_file, device=device, dtype=dtype, layer_ids=layer_ids,
                                          impl=impl, last_layer_features=last_layer_features)
    eos = eos_token_ids if eos_token_ids is not None else sorted(spec.eos_ids)
    return Engine(target, draft_model, eos, draft_vocab=draft_vocab, **engine_kw), spec
