"""Reference speculative decoding in plain PyTorch (docs/method.md §5): the correctness oracle.

One step per sequence: the draft proposes a block ``[anchor, d_1 .. d_K]`` (K = bs-1) in one
forward over its context cache; the target verifies the block causally over its KV cache; the
longest agreeing prefix plus the bonus token is committed; the target cache is cropped to the
committed positions and their target features are appended to the draft's context. Rows of a batch
accept different counts (ragged); the draft runs batched, the target verifies row by row on its own
HF cache (simple and exact), or, with ``batch_verify``, all rows in one forward over one batched cache
whose rejected columns are masked instead of cropped (the trainer's tau_real: one forward per step
instead of one per prompt). Without a draft it decodes autoregressively on the same path. With
``verify="tree"`` the target verifies a token tree built from the draft's distributions
(``dspine.tree``) in one forward (a 4D attention mask: the prefix and the node's ancestors; position
ids = prefix length + depth), and the cache keeps the accepted path's rows (attention-only targets).

Rollback. An attention layer drops rejected positions by cropping its KV cache. A hybrid target's
recurrent layers (conv window + gated delta-rule state) cannot be cropped: the verify pass runs on a
snapshot (deep copy) of the row's cache, and unless every draft token was accepted the committed
tokens (anchor .. d_a) are replayed on the untouched pre-verify cache. Replay rather than
per-position states because transformers' chunked delta-rule forward returns only the final state:
keeping one state per block position would need our own kernel, replay reuses the target's own
forward at the cost of a second pass over a + 1 tokens (this is the correctness oracle, not the fast
path). States stay in the dtype transformers keeps them in (fp32 in the fp32 tests). Shared
with the engine: the draft's ``forward_block``, the acceptance rule (``dspine.ops.accept``'s torch
references), the sampler and its per-request streams (``dspine.sampling``), the result type.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from dspine import sampling as rng
from dspine.config import target_layer_types
from dspine.draft_vocab import head_rows, spread_logits
from dspine.model import DraftCache, DSpineDraftModel
from dspine.ops.accept import accept_greedy, accept_sample
from dspine.sampling import (
    SamplingParams,
    check_tree_draft_temperature,
    draft_distribution,
    logits_to_probs,
    nonfinite_error,
    sample,
)
from dspine.stats import AcceptStats, GenerationResult
from dspine.target import TargetAdapter
from dspine.tree import Tree, build_tree, node_uniforms, path_nodes, verify_tree

# Slots the reference (CPU) backend verifies when the user gives none (infer.generate and infer.bench): the
# anchor + the first 3 draft slots. On a CPU the target's cost grows with the verified tokens, so the full
# 16-slot block loses to plain decoding; 4 is the width that did not lose in either 2-core sweep (docs/status.md,
# results/smollm2-cpu-verify-width*.json; benchmarks/reference/verify_width.py).
CPU_VERIFY_WIDTH = 4
TREE_BUDGET = 32  # default nodes of a verify tree (anchor included), both backends
THREADS_HELP = ("torch CPU threads (default: torch's own, one per physical core or $OMP_NUM_THREADS, lowered to the "
                "cores other runnable tasks leave idle right now, at least 1). torch's threads wait for each other "
                "whenever one is descheduled: on 2 busy cores 2 threads made speculative decoding 30x slower than 1")


def reference_verify_size(block_size: int | None, verify: str, draft_block_sizes) -> int | None:
    """Slots the reference backend verifies per step (anchor included), as infer.generate and infer.bench
    apply it: ``block_size`` when given; else, for a chain with drafts of ``draft_block_sizes``,
    :data:`CPU_VERIFY_WIDTH` capped at the smallest draft block; else None (the whole block, a tree, or
    autoregressive decoding)."""
    sizes = list(draft_block_sizes)
    if block_size is not None or verify != "chain" or not sizes:
        return block_size
    return min(CPU_VERIFY_WIDTH, *sizes)


def busy_cores(samples: int = 5, interval_s: float = 0.01) -> int | None:
    """Other tasks runnable right now: the median over ``samples`` reads of the kernel's count of runnable
    tasks (/proc/loadavg, 4th field), less this process's reading thread; None where there is no
    /proc/loadavg. Unlike the 1-minute load average it does not lag: a ``pip install`` that just ended
    does not count."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            return None
        if i + 1 < samples:
            time.sleep(interval_s)
    return max(0, int(statistics.median(counts)))


def idle_cores(cpu_count: int | None = None, busy: int | None = None) -> int:
    """Cores that other runnable tasks leave idle, at least 1 (``busy``: default :func:`busy_cores`; all
    cores where it is unknown)."""
    cpu_count = cpu_count or os.cpu_count() or 1
    busy = busy_cores() if busy is None else busy
    return cpu_count if busy is None else max(1, cpu_count - busy)


def set_cpu_threads(threads: int | None) -> int:
    """Set torch's CPU threads and return the count in use.

    ``threads`` given (``--threads``): exactly that, at most the machine's CPU count (a note on stderr when
    capped). None: torch's default (one per physical core, or $OMP_NUM_THREADS), lowered to
    :func:`idle_cores` (other runnable tasks, counted now) unless $OMP_NUM_THREADS is set, which is capped
    at the CPU count like ``threads``; a note on stderr says so.

    Raises ValueError for ``threads < 1``."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: must be >= 1")
        cores = os.cpu_count() or 1
        if threads > cores:  # extra threads only contend for the cores; 100000 of them fail to get their stacks
            print(f"note: --threads {threads} is more than this machine's {cores} CPU cores; using {cores}",
                  file=sys.stderr)
            threads = cores
        torch.set_num_threads(threads)
    elif os.environ.get("OMP_NUM_THREADS"):
        have, cores = torch.get_num_threads(), os.cpu_count() or 1
        if have > cores:  # the same cap as --threads: $OMP_NUM_THREADS=100000 would fail to get the stacks
            print(f"note: $OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is more than this machine's {cores} CPU "
                  f"cores; using {cores}", file=sys.stderr)
            torch.set_num_threads(cores)
    else:
        have, idle = torch.get_num_threads(), idle_cores()
        if idle < have:
            torch.set_num_threads(idle)
            print(f"note: {idle} torch CPU thread(s) instead of {have}: other runnable tasks leave {idle} core(s) idle "
                  "(--threads N overrides)", file=sys.stderr)
    return torch.get_num_threads()


def request_seeds(params: SamplingParams, n: int, seeds: list[int] | None, device) -> torch.Tensor:
    """``[n]`` int64 request seeds: ``seeds`` if given (one per prompt), else ``request_seed(params.seed, i)``."""
    if seeds is None:
        seeds = [rng.request_seed(params.seed, i) for i in range(n)]
    elif len(seeds) != n:
        raise ValueError(f"seeds has {len(seeds)} entries for {n} prompts")
    return torch.tensor([int(s) for s in seeds], dtype=torch.int64, device=device)


def check_prompts(prompts: list[list[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


class ReferenceDecoder:
    """Speculative (or autoregressive, without ``draft``) decoding of a batch of prompts.

    Args:
        target: the frozen target; its ``layer_ids`` are set from the draft config.
        draft: a DSpine/DFlash draft, or None for autoregressive decoding.
        eos_token_ids: tokens that end a sequence.
        verify_size: slots verified per step, anchor included (1 < verify_size <= the draft's block
            size; default = block size): the draft still runs its whole block (it was trained on
            it) and the target verifies the first ``verify_size`` slots (a tree: at most
            ``verify_size - 1`` deep). A narrower verify is cheaper where the target's cost grows
            with the tokens per forward (a CPU).
        verify: "chain" (the draft's argmax/sampled block) or "tree" (``dspine.tree``).
        tree_budget: nodes per tree, anchor included (``verify="tree"``); built best first at T = 0, the
            chain first at T > 0 (``dspine.tree.build_tree``'s ``chain_first``).
        batch_verify: one target forward per step for all rows (prefill and chain verify) on one
            batched HF cache instead of one forward per row: right-padded prompts, and rejected
            verify slots stay in the cache as masked columns (a 4D additive mask ``[B, 1, W, C + W]``
            of each row's valid cache columns, causal inside the block; position ids per row) rather
            than being cropped. Same acceptance, same tokens up to fp rounding of the batched GEMMs
            and of the masked softmax (bitwise equal on the CPU tests). The cache grows by W columns
            per step for every row (not only by the committed ones): meant for short decodes (the
            trainer's tau_real). Needs a draft, ``verify="chain"`` and a target without recurrent or
            sliding-window layers (:meth:`can_batch_verify`).
        draft_vocab: token ids the draft may propose (``infer.engine.Engine``'s argument; ``dspine.draft_vocab``),
            or None (the whole vocabulary).
    Raises:
        ValueError: ``verify_size`` outside 2..block size, an unknown ``verify``, a tree budget < 2,
            a tree without a draft, ``batch_verify`` without a draft, with a tree or with a target
            that :meth:`can_batch_verify` refuses, a ``draft_vocab`` without a draft or with ids that
            ``dspine.draft_vocab.check_draft_vocab`` refuses.
    """

    def __init__(self, target: TargetAdapter, draft: DSpineDraftModel | None, eos_token_ids,
                 verify_size: int | None = None, verify: str = "chain", tree_budget: int = TREE_BUDGET,
                 batch_verify: bool = False, draft_vocab: torch.Tensor | None = None):
        if verify not in ("chain", "tree"):
            raise ValueError(f"verify={verify!r} must be 'chain' or 'tree'")
        if verify == "tree" and (draft is None or tree_budget < 2):
            raise ValueError(f"verify='tree' needs a draft and tree_budget >= 2 (got {tree_budget})")
        if batch_verify and (draft is None or verify != "chain" or not self.can_batch_verify(target)):
            raise ValueError("batch_verify needs a draft, verify='chain' and a target with only full-attention "
                             f"layers (got draft={draft is not None}, verify={verify!r}, target "
                             f"{target.name or type(target.model).__name__}: recurrent={target.recurrent}, "
                             f"layer types {sorted(set(target_layer_types(target.config)))})")
        self.batch_verify = batch_verify
        self.target = target
        self.draft = draft
        self.verify, self.tree_budget = verify, tree_budget
        self.eos = set(int(e) for e in eos_token_ids)
        if draft is not None:
            target.set_layer_ids(draft.config.target_layer_ids, draft.config.last_layer_features)
            self.block_size = draft.config.block_size
            self.mask_token_id = draft.config.mask_token_id
            self.verify_size = verify_size or self.block_size
            if not 2 <= self.verify_size <= self.block_size:
                raise ValueError(f"verify_size={verify_size} must be in 2..{self.block_size} (the draft's block size)")
        else:
            self.block_size = self.verify_size = 1
        if draft_vocab is not None and draft is None:
            raise ValueError("draft_vocab needs a draft (it selects the tokens the draft may propose)")
        self.draft_vocab, self.draft_head = head_rows(draft_vocab, target.lm_head_weight)  # as infer.engine.Engine's

    @staticmethod
    def can_batch_verify(target: TargetAdapter) -> bool:
        """Whether ``batch_verify`` runs on ``target``: every layer full attention (a custom 4D mask
        replaces the target's own masks, so a sliding window would be lost; recurrent states cannot
        skip the masked columns)."""
        return not target.recurrent and all(t == "full_attention" for t in target_layer_types(target.config))

    def _batch_mask(self, valid: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
        """Additive mask ``[B, 1, W, C + W]`` (target dtype) for W new tokens per row over C cached columns:
        a query sees the cached columns where ``valid [B, C]`` and the new columns up to itself where
        ``new_valid [B, W]`` (False = a prompt's right padding)."""
        B, W = new_valid.shape
        causal = torch.ones(W, W, dtype=torch.bool, device=valid.device).tril()
        allowed = torch.cat([valid[:, None, :].expand(B, W, valid.shape[1]), causal[None] & new_valid[:, None, :]], -1)
        mask = torch.zeros(B, 1, W, allowed.shape[-1], dtype=self.target.dtype, device=valid.device)
        return mask.masked_fill_(~allowed[:, None], torch.finfo(mask.dtype).min)

    @staticmethod
    def chain_first(params: SamplingParams) -> bool:
        """Whether trees keep the chain first: at T > 0 only (its rejection sampling needs it; best first at
        T = 0), the default of ``infer.engine.Engine.chain_first``."""
        return not params.greedy

    def draft_logits(self, block: torch.Tensor, draft_cache: DraftCache) -> torch.Tensor:
        """Draft logits ``[B, K, V]`` (fp32, K = verify_size - 1) for blocks ``[B, bs]`` = [anchor, MASK, ...]."""
        hidden = self.draft.forward_block(self.target.embed(block), draft_cache)
        h = hidden[:, 1 : self.verify_size]
        if self.draft_head is None:
            return self.target.lm_head(h).float()
        sub = F.linear(h.to(self.draft_head.dtype), self.draft_head).float()  # the draft vocabulary's rows only
        return spread_logits(sub, self.draft_vocab, self.target.lm_head_weight.shape[0])

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> GenerationResult:
        """Decode every prompt up to EOS (kept in the output) or ``max_new_tokens``.

        Args:
            prompts: token ids per prompt (each non-empty).
            params: sampling settings; T = 0 is greedy (exact match), T > 0 chain rejection sampling, or with
                ``params.invariant`` drafter-invariant verification (the plain decode's text for the seed).
            seeds: one request seed per prompt (default ``request_seed(params.seed, i)``): a prompt's
                sample depends only on its seed, never on the other prompts (``dspine.sampling``).
        Returns :class:`GenerationResult` (per-prompt :class:`AcceptStats`). Raises ValueError (an empty
        prompt, bad params, a ``seeds`` list of the wrong length), FloatingPointError (non-finite logits).
        """
        params.validate()
        check_tree_draft_temperature(params, self.verify == "tree" and self.draft is not None)
        check_prompts(prompts)
        t0 = time.perf_counter()
        dev = self.target.device
        B = len(prompts)
        seed = request_seeds(params, B, seeds, dev)
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        reasons = ["length"] * B
        stats = [AcceptStats(self.verify_size) for _ in range(B)]
        use_draft = self.draft is not None
        loops = 0

        def commit(b: int, tokens: list[int]) -> int:
            """Append tokens to row b up to EOS / max_new_tokens; returns how many were committed."""
            n = 0
            for tok in tokens:
                if done[b]:
                    break
                out[b].append(tok)
                n += 1
                if tok in self.eos:
                    done[b], reasons[b] = True, "stop"
                elif len(out[b]) >= params.max_new_tokens:
                    done[b] = True
            return n

        def target_token(b: int, logits: torch.Tensor) -> int:
            """The target's token for row b from its logits ``[V]`` at output position len(out[b])."""
            if not torch.isfinite(logits).all():
                raise nonfinite_error("target")
            if params.greedy:
                return int(logits.argmax())
            p, ids = logits_to_probs(logits[None], params.temperature, params.top_p, params.top_k, with_ids=True)
            return int(sample(p, seed[b : b + 1], rng.STREAM_TARGET, torch.tensor([len(out[b])], device=dev), ids)[0])

        # -- prefill: one row at a time on its own HF cache (batch_verify: all rows, right-padded) -----
        caches, feats, anchors = [], [], []
        if self.batch_verify:
            L = max(map(len, prompts))
            ids = torch.zeros(B, L, dtype=torch.long, device=dev)
            valid = torch.zeros(B, L, dtype=torch.bool, device=dev)  # [B, C]: cache columns a row attends to
            for b, prompt in enumerate(prompts):
                ids[b, : len(prompt)] = torch.tensor(prompt, device=dev)
                valid[b, : len(prompt)] = True
            o = self.target(ids, position_ids=torch.arange(L, device=dev).expand(B, L),
                            attention_mask=self._batch_mask(valid[:, :0], valid), use_cache=True)
            batch_cache = o.past_key_values
            for b, prompt in enumerate(prompts):
                feats.append(o.features[b : b + 1, : len(prompt)])
                anchors.append(target_token(b, o.logits[b, len(prompt) - 1].float()))
                commit(b, [anchors[-1]])
        for b, prompt in enumerate(prompts if not self.batch_verify else []):
            o = self.target(torch.tensor([prompt], device=dev), use_cache=True, features=use_draft)
            caches.append(o.past_key_values)
            feats.append(o.features)
            anchors.append(target_token(b, o.logits[0, -1].float()))
            commit(b, [anchors[-1]])
        prefill_s = time.perf_counter() - t0

        if use_draft:
            bs, W = self.block_size, self.verify_size
            K = W - 1
            dcache = DraftCache(self.draft, B, max(map(len, prompts)) + params.max_new_tokens + bs + 1)
            for b, f in enumerate(feats):
                dcache.append(f, torch.tensor([f.shape[1]], device=dev), rows=torch.tensor([b], device=dev))

        while not all(done):
            loops += 1
            active = [b for b in range(B) if not done[b]]
            if not use_draft:
                for b in active:
                    pos = torch.tensor([[len(prompts[b]) + len(out[b]) - 1]], device=dev)
                    o = self.target(torch.tensor([[anchors[b]]], device=dev), position_ids=pos,
                                    past_key_values=caches[b], use_cache=True, features=False)
                    caches[b] = o.past_key_values
                    anchors[b] = target_token(b, o.logits[0, -1].float())
                    stats[b].record(commit(b, [anchors[b]]))
                continue

            # -- draft: one block per row, batched; draft token k sits at output position n + k - 1 ------
            block = torch.full((B, bs), self.mask_token_id, dtype=torch.long, device=dev)
            block[:, 0] = torch.tensor(anchors, device=dev)
            d_logits = self.draft_logits(block, dcache)  # [B, K, V]
            if not torch.isfinite(d_logits).all():
                raise nonfinite_error("draft")
            n_out = torch.tensor([len(o) for o in out], device=dev)
            slot_pos = n_out[:, None] + torch.arange(K, device=dev)  # [B, K]
            if params.greedy:
                block[:, 1:W] = d_logits.argmax(-1)
                p_draft = None
            else:
                p_draft, d_ids = draft_distribution(d_logits, params)
                # invariant: the draft races with the noise of the target's own draw at each output position
                stream = rng.STREAM_TARGET if params.invariant_sampling else rng.STREAM_DRAFT
                block[:, 1:W] = sample(p_draft, seed, stream, slot_pos, d_ids)
            tree = None
            if self.verify == "tree":  # scores: the sampling distribution, or softmax(logits) at T = 0
                q = torch.softmax(d_logits, -1) if params.greedy else p_draft
                tree = build_tree(block[:, 0], q, self.tree_budget, chain_tokens=block[:, 1:W],
                                  chain_first=self.chain_first(params))
            block = block[:, :W]  # the verified slots of the chain

            # -- verify + accept, row by row (the acceptance rule of dspine.ops.accept) ----------------
            new_feats = torch.zeros(B, W, feats[0].shape[-1], device=dev, dtype=feats[0].dtype)
            counts = torch.zeros(B, dtype=torch.long, device=dev)
            if self.batch_verify:  # every row in one forward; row b's slots sit at columns C .. C + W - 1
                C = valid.shape[1]
                pos = dcache.lengths[:, None].long() + torch.arange(W, device=dev)
                o = self.target(block, position_ids=pos, attention_mask=self._batch_mask(
                    valid, torch.ones(B, W, dtype=torch.bool, device=dev)), past_key_values=batch_cache, use_cache=True)
                batch_cache, t_all, host_block = o.past_key_values, o.logits.float(), block.tolist()
                valid = torch.cat([valid, torch.zeros(B, W, dtype=torch.bool, device=dev)], 1)
                if params.greedy:  # all rows' acceptance at once: two host syncs per step, not a few per row
                    act = torch.tensor(active, device=dev)
                    if not torch.isfinite(t_all[act]).all():
                        raise nonfinite_error("target")
                    a_act, bonus_act = accept_greedy(block[act, 1:], t_all[act].argmax(-1), impl="torch")
                    greedy = dict(zip(active, zip(a_act.tolist(), bonus_act.tolist())))
            for b in active:
                if tree is not None:
                    start = int(dcache.lengths[b])  # position of the anchor
                    if self.target.recurrent:
                        raise ValueError("tree verification needs an attention-only target (hybrid targets: chain)")
                    tokens, f = self._verify_tree_row(b, tree, start, caches[b], params, p_draft, seed, n_out)
                    stats[b].record(commit(b, tokens))
                    new_feats[b, : len(tokens)] = f
                    counts[b] = len(tokens)
                    anchors[b] = tokens[-1]
                    continue
                if self.batch_verify and params.greedy:
                    a, bonus = greedy[b]
                else:
                    if self.batch_verify:
                        t_logits = t_all[b]  # [W, V]
                    else:
                        start = int(dcache.lengths[b])  # position of the anchor
                        pos = torch.arange(start, start + W, device=dev)[None]
                        snapshot = copy.deepcopy(caches[b]) if self.target.recurrent else caches[b]
                        o = self.target(block[b : b + 1], position_ids=pos, past_key_values=snapshot, use_cache=True)
                        t_logits = o.logits[0].float()  # [W, V]
                    if not torch.isfinite(t_logits).all():
                        raise nonfinite_error("target")
                    if params.greedy:
                        a, bonus = accept_greedy(block[b : b + 1, 1:], t_logits.argmax(-1)[None], impl="torch")
                    else:
                        p_t, t_ids = logits_to_probs(t_logits[None], params.temperature, params.top_p, params.top_k,
                                                     with_ids=True)
                        if params.invariant_sampling:  # the target's own draws; the matching prefix passes
                            draws = sample(p_t, seed[b : b + 1], rng.STREAM_TARGET,
                                           n_out[b : b + 1, None] + torch.arange(W, device=dev), t_ids)
                            a, bonus = accept_greedy(block[b : b + 1, 1:], draws, impl="torch")
                        else:
                            u = rng.uniforms(seed[b : b + 1], rng.STREAM_ACCEPT, slot_pos[b : b + 1])
                            e = rng.bonus_noise(seed[b : b + 1], rng.STREAM_TARGET, n_out[b : b + 1], p_t.shape[-1],
                                                t_ids)
                            a, bonus = accept_sample(block[b : b + 1, 1:], p_t, p_draft[b : b + 1], u, e,
                                                     impl="torch")
                    a, bonus = int(a), int(bonus)
                counts[b] = a + 1
                anchors[b] = bonus
                if self.batch_verify:  # the committed slots become visible columns; features of all rows below
                    stats[b].record(commit(b, host_block[b][1 : a + 1] + [bonus]))
                    continue
                stats[b].record(commit(b, block[b, 1 : a + 1].tolist() + [bonus]))
                # keep the target cache to the committed positions: anchor .. d_a
                if not self.target.recurrent:
                    caches[b] = o.past_key_values
                    self.target.crop_cache(caches[b], start + a + 1)
                elif a + 1 == W:  # all accepted: the verify pass's states are the committed ones
                    caches[b] = o.past_key_values
                else:  # roll back: replay anchor .. d_a on the pre-verify cache
                    self.target(block[b : b + 1, : a + 1], position_ids=pos[:, : a + 1], past_key_values=caches[b],
                                use_cache=True, features=False)
                new_feats[b, : a + 1] = o.features[0, : a + 1]
            if self.batch_verify:
                valid[:, C:] = torch.arange(W, device=dev) < counts[:, None]
                new_feats = o.features
            dcache.append(new_feats, counts)

        return GenerationResult(out, reasons, stats, time.perf_counter() - t0, prefill_s, loops)

    def _verify_tree_row(self, b: int, trees: Tree, start: int, cache, params: SamplingParams, p_draft, seed, n_out):
        """Verify row b's tree over its HF cache (prefix of ``start`` positions): one forward with a 4D
        additive mask, acceptance by ``dspine.tree.verify_tree``, then the cache keeps the prefix and the
        accepted path's rows. Returns the committed tokens (path, then the bonus) and their features
        ``[a + 1, k·H]`` (the anchor's and the accepted nodes')."""
        dev, K = self.target.device, self.verify_size - 1
        tree = Tree(*(getattr(trees, f)[b : b + 1] for f in ("tokens", "parent", "depth", "chain", "anc")))
        N = tree.size
        mask = torch.zeros(1, 1, N, start + N, device=dev, dtype=self.target.dtype)
        mask[..., start:] = (~tree.anc[:, None]) * torch.finfo(mask.dtype).min
        o = self.target(tree.tokens, position_ids=start + tree.depth, attention_mask=mask, past_key_values=cache,
                        use_cache=True)
        t_logits = o.logits[0].float()  # [N, V]: the target's next token after every node
        if not torch.isfinite(t_logits).all():
            raise nonfinite_error("target")
        if params.greedy:
            last, a, bonus = verify_tree(tree, target_argmax=t_logits.argmax(-1)[None])
        else:
            p_t, t_ids = logits_to_probs(t_logits[None], params.temperature, params.top_p, params.top_k, with_ids=True)
            u = node_uniforms(tree, seed[b : b + 1], n_out[b : b + 1])
            e = rng.bonus_noise(seed[b : b + 1], rng.STREAM_TARGET, n_out[b : b + 1], p_t.shape[-1], t_ids)
            last, a, bonus = verify_tree(tree, p_target=p_t, q=p_draft[b : b + 1], u=u, exp_noise=e)
        path = path_nodes(tree, last, K)[0, : int(a) + 1]  # the anchor, then the accepted nodes
        for layer in cache.layers:  # DynamicLayer keys/values [1, H, start + N, D]
            if getattr(layer, "is_sliding", False):
                raise ValueError("tree verification needs full-attention cache layers (sliding-window target)")
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, start + path]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, start + path]], dim=2)
        return tree.tokens[0, path[1:]].tolist() + [int(bonus)], o.features[0, path]
