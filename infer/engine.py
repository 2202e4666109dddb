"""The CUDA inference engine: static caches, one graph-captured step, ragged batches with refill.

Per step (docs/method.md §5), for all B batch slots at once and with no host synchronisation inside:
draft block -> draft tokens (argmax, or a sample from p_d kept for verification) -> target
verify over the static KV cache (features captured) -> acceptance on the GPU (exact match, or
chain rejection sampling) -> commit (EOS / max_new_tokens cut, histogram) -> draft context append
-> lengths += a + 1. The target cache keeps every verified position, but only ``lengths`` of
them count: rejected slots are simply overwritten by the next step. The host looks at the ``done``
flags once per step, harvests finished rows and refills their slots from the queue (prefill is
eager, one prompt at a time), so benchmarks run at a fixed concurrency.

On a GPU the step is captured as a CUDA graph per (batch size, sampling settings); on the CPU the
same code runs eagerly with the PyTorch reference kernels, which is how the tests check it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspine.checkpoint import load_draft
from dspine.model import DraftCache, DSpineDraftModel
from dspine.ops.accept import accept_greedy, accept_sample, commit_step
from dspine.sampling import SamplingParams, logits_to_probs
from dspine.stats import AcceptStats
from dspine.target import TargetSpec, assert_compatible
from infer.model import EngineTarget, KVCache


@dataclass
class EngineResult:
    token_ids: list[list[int]]
    finish_reasons: list[str]
    stats: AcceptStats
    elapsed_s: float
    prefill_s: float
    steps: int
    per_prompt_steps: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class _Slots:
    """Static per-slot state for batch size B (device tensors, updated in place by the step)."""

    def __init__(self, B: int, vb: int, dbs: int, max_new: int, device, mask_id: int):
        i32, i64 = torch.int32, torch.int64
        self.B, self.vb = B, vb
        self.anchor = torch.zeros(B, dtype=i64, device=device)
        self.lengths = torch.zeros(B, dtype=i32, device=device)
        self.out_tokens = torch.zeros(B, max_new, dtype=i64, device=device)
        self.out_len = torch.zeros(B, dtype=i32, device=device)
        self.max_new = torch.ones(B, dtype=i32, device=device)
        self.done = torch.ones(B, dtype=torch.int8, device=device)
        self.hist = torch.zeros(B, vb + 1, dtype=i32, device=device)
        self.block = torch.zeros(B, vb, dtype=i64, device=device)
        self.dblock = torch.full((B, dbs), mask_id, dtype=i64, device=device)
        self.nonfinite = torch.zeros(1, dtype=torch.bool, device=device)
        self.ar_zero = torch.zeros(B, dtype=i32, device=device)


class Engine:
    """Speculative (or autoregressive) generation over a batch of slots.

    Args:
        target: the engine's target model.
        draft: a DSpine/DFlash draft (moved to the target's device and dtype, weights fused), or None
            (autoregressive only). Its embedding and lm_head are the target's.
        eos_token_ids: tokens that end a sequence.
        max_batch: most concurrent sequences; max_seq: prompt + new tokens + block per sequence.
        cuda_graphs: capture the step as a CUDA graph (GPU only).
        verify_size: slots verified per step (<= the draft's block size; default = block size).
        force_accept: benchmark only — accept exactly this many draft tokens per step whatever the
            target says (the "oracle draft" of the engine benchmark); output is then not the target's.
    """

    def __init__(self, target: EngineTarget, draft: DSpineDraftModel | None, eos_token_ids, max_batch: int = 8,
                 max_seq: int = 4096, cuda_graphs: bool | None = None, verify_size: int | None = None,
                 force_accept: int | None = None, max_new_cap: int | None = None):
        self.target, self.draft = target, draft
        self.device = target.embed.device
        self.impl = target.impl
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        if target.embed.dtype == torch.float16 and target.args.model_type.startswith("qwen"):
            raise ValueError("fp16 with a Qwen-family target overflows to NaN; use bf16 or fp32 (docs/method.md §8.15)")
        if draft is not None:
            draft = draft.to(device=self.device, dtype=target.embed.dtype).eval().fuse_weights()
            self.draft = draft
        dbs = draft.config.block_size if draft is not None else 1
        self.vb = verify_size or dbs
        if not 1 <= self.vb <= dbs:
            raise ValueError(f"verify_size={verify_size} must be in 1..{dbs} (the draft's block size)")
        self.force_accept = force_accept
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
        self.cache: KVCache = target.new_cache(max_batch, max_seq + dbs + 1)
        self.draft_cache = DraftCache(draft, max_batch, max_seq + dbs + 1) if draft is not None else None
        self._slots: dict[int, _Slots] = {}
        self._graphs: dict[tuple, object] = {}

    # -- state views ---------------------------------------------------------------------------
    def _slots_for(self, B: int) -> _Slots:
        if B not in self._slots:
            cfg = self.draft.config if self.draft is not None else None
            self._slots[B] = _Slots(B, self.vb, cfg.block_size if cfg else 1, self.max_new_cap, self.device,
                                    cfg.mask_token_id if cfg else 0)
        return self._slots[B]

    def _cache_view(self, B: int):
        kv = KVCache.__new__(KVCache)
        kv.k, kv.v = [k[:B] for k in self.cache.k], [v[:B] for v in self.cache.v]
        kv.batch, kv.seq = B, self.cache.seq
        dc = None
        if self.draft_cache is not None:  # lengths shared with the slots: draft appends advance them
            dc = self.draft_cache.view(B, lengths=self._slots_for(B).lengths)
        return kv, dc

    def draft_logits(self, block: torch.Tensor, draft_cache: DraftCache) -> torch.Tensor:
        """Draft logits ``[B, verify_size-1, V]`` (model dtype) for blocks ``[B, bs]`` = [anchor, MASK, ...]
        whose anchor sits at ``draft_cache.lengths[b]``: the draft over the target's embedding and head."""
        hidden = self.draft.forward_block(F.embedding(block, self.target.embed), draft_cache, impl=self.impl)
        return F.linear(hidden[:, 1 : self.vb], self.target.head)

    # -- sampling helpers (graph-safe: no host reads) ------------------------------------------
    @staticmethod
    def _race(probs: torch.Tensor) -> torch.Tensor:
        """One sample per row by the exponential race: argmax p / E, E ~ Exp(1) (exact, sync-free)."""
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)

    # -- the steps -------------------------------------------------------------------------------
    def _spec_step(self, s: _Slots, kv: KVCache, dc: DraftCache, p: SamplingParams):
        vb, K = s.vb, s.vb - 1
        s.dblock[:, 0] = s.anchor
        d_logits = self.draft_logits(s.dblock, dc)
        if p.greedy:
            dtok = d_logits.argmax(-1)
        else:
            p_d = logits_to_probs(d_logits, p.temperature, p.top_p, p.top_k)
            dtok = self._race(p_d)
        s.block[:, 0] = s.anchor
        s.block[:, 1:] = dtok
        positions = s.lengths[:, None].long() + torch.arange(vb, device=self.device)
        t_logits, feats = self.target.forward_step(s.block, positions, kv, s.lengths)
        s.nonfinite |= ~torch.isfinite(t_logits).all()
        if self.force_accept is not None:
            t_arg = t_logits.argmax(-1)
            a = torch.full((s.B,), min(self.force_accept, K), dtype=torch.int32, device=self.device)
            bonus = t_arg.gather(1, a[:, None].long())[:, 0]
        elif p.greedy:
            a, bonus = accept_greedy(dtok, t_logits.argmax(-1), impl=self.impl)
        else:
            p_t = logits_to_probs(t_logits, p.temperature, p.top_p, p.top_k)
            u = torch.rand(s.B, K, device=self.device)
            noise = torch.empty(s.B, p_t.shape[-1], device=self.device).exponential_()
            a, bonus = accept_sample(dtok, p_t, p_d, u, noise, impl=self.impl)
        live = s.done == 0
        commit_step(s.block, a, bonus, s.out_tokens, s.out_len, s.max_new, s.done, self.eos, s.hist, impl=self.impl)
        dc.append(feats, (a.to(torch.int32) + 1) * live, impl=self.impl)  # advances s.lengths (shared)
        s.anchor.copy_(torch.where(live, bonus, s.anchor))

    def _ar_step(self, s: _Slots, kv: KVCache, p: SamplingParams):
        tok = s.anchor[:, None]
        logits, _ = self.target.forward_step(tok, s.lengths[:, None].long(), kv, s.lengths, want_features=False)
        logits = logits[:, 0]
        s.nonfinite |= ~torch.isfinite(logits).all()
        nxt = logits.argmax(-1) if p.greedy else self._race(logits_to_probs(logits, p.temperature, p.top_p, p.top_k))
        live = s.done == 0
        commit_step(tok, s.ar_zero, nxt, s.out_tokens, s.out_len, s.max_new, s.done, self.eos, s.hist[:, :2],
                    impl=self.impl)
        s.lengths.add_(live.to(torch.int32))
        s.anchor.copy_(torch.where(live, nxt, s.anchor))

    def _step_fn(self, B: int, p: SamplingParams, spec: bool):
        s = self._slots_for(B)
        kv, dc = self._cache_view(B)
        if spec:
            return lambda: self._spec_step(s, kv, dc, p)
        return lambda: self._ar_step(s, kv, p)

    def _runner(self, B: int, p: SamplingParams, spec: bool):
        """The step for this configuration: a replayable CUDA graph, or the eager function."""
        fn = self._step_fn(B, p, spec)
        if not self.cuda_graphs:
            return fn
        key = (B, spec, p.temperature, p.top_p, p.top_k)
        if key not in self._graphs:
            s = self._slots_for(B)
            s.done.fill_(1)  # warm-up and capture on idle slots: commits nothing, lengths stay
            s.lengths.zero_()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()  # compiles the Triton kernels, warms cuBLAS
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            s.nonfinite.zero_()
            self._graphs[key] = graph
        return self._graphs[key].replay

    # -- prefill / admission ---------------------------------------------------------------------
    def _admit(self, s: _Slots, b: int, prompt: list[int], p: SamplingParams, spec: bool, kv, dc):
        P = len(prompt)
        need = P + p.max_new_tokens + s.vb
        if need > self.max_seq:
            raise ValueError(f"prompt of {P} tokens + max_new_tokens={p.max_new_tokens} + block exceeds the "
                             f"engine context of {self.max_seq} positions")
        if p.max_new_tokens > self.max_new_cap:
            raise ValueError(f"max_new_tokens={p.max_new_tokens} exceeds the engine cap {self.max_new_cap}")
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        logits, feats = self.target.prefill(ids, b, kv, want_features=spec)
        s.nonfinite |= ~torch.isfinite(logits).all()
        if p.greedy:
            first = logits.argmax(-1)
        else:
            first = self._race(logits_to_probs(logits.float(), p.temperature, p.top_p, p.top_k))
        s.anchor[b] = first
        s.lengths[b] = 0 if spec else P
        s.out_tokens[b, 0] = first
        s.out_len[b] = 1
        s.max_new[b] = p.max_new_tokens
        s.done[b] = (torch.isin(first, self.eos) | (p.max_new_tokens <= 1)).to(torch.int8)
        s.hist[b].zero_()
        if spec:  # the prompt's context K/V; lengths[b] becomes P
            rows = torch.tensor([b], device=self.device)
            dc.append(feats[None], torch.tensor([P], device=self.device), rows=rows, impl=self.impl)

    # -- public ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, concurrency: int | None = None,
                 use_draft: bool = True) -> EngineResult:
        """Decode every prompt; at most ``concurrency`` (default: max_batch) at a time, slots refilled
        from the queue as rows finish. Output tokens include the EOS that ended a row.

        Raises:
            ValueError: a prompt that does not fit the context, or empty prompts.
            FloatingPointError: non-finite target logits (e.g. fp16 overflow), never silently "τ = 1".
        """
        params.validate()
        if not prompts or any(len(x) == 0 for x in prompts):
            raise ValueError("every prompt needs at least one token")
        spec = use_draft and self.draft is not None
        B = min(concurrency or self.max_batch, self.max_batch, len(prompts))
        s = self._slots_for(B)
        kv, dc = self._cache_view(B)
        torch.manual_seed(params.seed)
        step = self._runner(B, params, spec)
        t0 = time.perf_counter()
        prefill_s = 0.0
        queue = deque(enumerate(prompts))
        owner: list[int | None] = [None] * B
        self.slot_owner = owner  # prompt index per slot (read by test oracles and debugging)
        results: list[list[int] | None] = [None] * len(prompts)
        reasons = [""] * len(prompts)
        steps_per = [0] * len(prompts)
        start_step = [0] * len(prompts)
        hist = torch.zeros(self.vb + 1, dtype=torch.long)
        s.done.fill_(1)
        s.nonfinite.zero_()

        def admit(b: int, n_steps: int):
            nonlocal prefill_s
            tp = time.perf_counter()
            if queue:
                idx, prompt = queue.popleft()
                owner[b] = idx
                self._admit(s, b, prompt, params, spec, kv, dc)
                start_step[idx] = n_steps
            else:
                owner[b] = None
            prefill_s += time.perf_counter() - tp

        for b in range(B):
            admit(b, 0)
        n_steps = 0
        while any(o is not None for o in owner):
            flags = torch.cat([s.done, s.nonfinite.to(torch.int8)]).cpu()  # the one sync per step
            if flags[-1]:
                raise FloatingPointError("non-finite target logits (NaN/Inf): check the dtype (fp16 overflows "
                                         "Qwen-family layers) and the weights")
            finished = [b for b in range(B) if owner[b] is not None and flags[b]]
            if finished:
                out_len = s.out_len.cpu()
                out_tok = s.out_tokens[:, : int(out_len.max())].cpu()
                h = s.hist.cpu()
                for b in finished:
                    idx = owner[b]
                    toks = out_tok[b, : int(out_len[b])].tolist()
                    results[idx] = toks
                    reasons[idx] = "stop" if toks and toks[-1] in self.eos_set else "length"
                    steps_per[idx] = n_steps - start_step[idx]
                    hist[: h.shape[1]] += h[b].long()
                    admit(b, n_steps)
                continue  # re-read the flags: a refilled row may already be done (EOS first)
            step()
            n_steps += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        stats = AcceptStats(self.vb if spec else 1, hist[: (self.vb if spec else 1) + 1].tolist())
        return EngineResult([r or [] for r in results], reasons, stats, elapsed, prefill_s, n_steps, steps_per)


# -----------------------------------------------------------------------------------------------
# construction


def load_engine(target_path: str, gguf_file: str | None, draft_path: str | None, *, device="cuda",
                dtype=torch.bfloat16, impl: str | None = None, max_batch: int = 8, max_seq: int = 4096,
                cuda_graphs: bool | None = None, verify_size: int | None = None, eos_token_ids=None,
                check_max_context: int | None = None, max_new_cap: int | None = None):
    """Target + draft (after the ``dspine.check`` compatibility checks) -> :class:`Engine`.

    Raises:
        ValueError: draft/target mismatch (every failed check listed), fp16 with a Qwen target.
    """
    impl = impl or ("triton" if torch.device(device).type == "cuda" else "torch")
    spec = TargetSpec.from_pretrained(target_path, gguf_file)
    draft_model = None
    layer_ids = None
    if draft_path:
        draft_model = load_draft(draft_path, device=device, dtype=dtype)
        assert_compatible(spec, draft_model.config, max_context=check_max_context)
        layer_ids = draft_model.config.target_layer_ids
    if dtype == torch.float16 and spec.model_type.startswith("qwen"):
        raise ValueError("fp16 with a Qwen-family target overflows to NaN; use bf16 or fp32 (docs/method.md §8.15)")
    target = EngineTarget.from_pretrained(target_path, gguf_file, device=device, dtype=dtype, layer_ids=layer_ids,
                                          impl=impl)
    eos = eos_token_ids if eos_token_ids is not None else sorted(spec.eos_ids)
    return Engine(target, draft_model, eos, max_batch=max_batch, max_seq=max_seq, cuda_graphs=cuda_graphs,
                  verify_size=verify_size, max_new_cap=max_new_cap), spec
