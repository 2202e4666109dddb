"""Reference speculative decoding in plain PyTorch (docs/method.md §5): the correctness oracle.

One step per sequence: the draft proposes a block ``[anchor, d_1 .. d_K]`` (K = bs-1) in one
forward over its context cache; the target verifies the block causally over its KV cache; the
longest agreeing prefix (exact match at T = 0, chain rejection sampling at T > 0) plus the bonus
token is committed; the target cache is cropped to the committed positions and their target
features are appended to the draft's context. Rows of a batch accept different counts (ragged);
the draft runs batched, the target verifies row by row on its own HF cache (simple and exact).
Without a draft it decodes autoregressively on the same path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspine.model import DraftCache, DSpineDraftModel
from dspine.sampling import SamplingParams, chain_accept, greedy_accept, logits_to_probs, sample
from dspine.stats import AcceptStats
from dspine.target import TargetAdapter


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per prompt (EOS included when hit)
    finish_reasons: list[str]  # "stop" (EOS) or "length"
    stats: AcceptStats
    prefill_s: float = 0.0
    elapsed_s: float = 0.0  # wall time of the whole call (prefill included)
    steps_per_row: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params.temperature, params.top_p, params.top_k), gen)


class ReferenceDecoder:
    """Speculative (or autoregressive, without ``draft``) decoding of a batch of prompts.

    Args:
        target: the frozen target; its ``layer_ids`` are set from the draft config.
        draft: a DSpine/DFlash draft, or None for autoregressive decoding.
        eos_token_ids: tokens that end a sequence.
    """

    def __init__(self, target: TargetAdapter, draft: DSpineDraftModel | None, eos_token_ids):
        self.target = target
        self.draft = draft
        self.eos = set(int(e) for e in eos_token_ids)
        if draft is not None:
            target.set_layer_ids(draft.config.target_layer_ids, draft.config.last_layer_features)
            self.block_size = draft.config.block_size
            self.mask_token_id = draft.config.mask_token_id
        else:
            self.block_size = 1

    def draft_logits(self, block: torch.Tensor, dcache: DraftCache) -> torch.Tensor:
        """Draft logits ``[B, K, V]`` (fp32) for blocks ``[B, bs]`` = [anchor, MASK, ...]."""
        hidden = self.draft.forward_block(self.target.embed(block), dcache)
        return self.target.lm_head(hidden[:, 1:]).float()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationResult:
        params.validate()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        t0 = time.perf_counter()
        dev = self.target.device
        gen = torch.Generator(device=dev).manual_seed(params.seed)
        B = len(prompts)
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        reasons = ["length"] * B
        steps = [0] * B
        stats = AcceptStats(max(self.block_size, 1))
        use_draft = self.draft is not None

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

        # -- prefill: one row at a time on its own HF cache ------------------------------------------
        caches, feats, anchors = [], [], []
        for b, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=dev)
            o = self.target(ids, use_cache=True, features=use_draft)
            caches.append(o.past_key_values)
            feats.append(o.features)
            first = int(_pick(o.logits[0, -1].float(), params, gen))
            commit(b, [first])
            anchors.append(first)
        prefill_s = time.perf_counter() - t0

        if use_draft:
            bs = self.block_size
            cap = max(len(p) for p in prompts) + params.max_new_tokens + bs + 1
            dcache = DraftCache(self.draft, B, cap)
            kH = feats[0].shape[-1]
            pf = torch.zeros(B, max(len(p) for p in prompts), kH, device=dev, dtype=feats[0].dtype)
            for b, f in enumerate(feats):
                pf[b, : f.shape[1]] = f[0]
            dcache.append(pf, torch.tensor([len(p) for p in prompts], device=dev))

        while not all(done):
            active = [b for b in range(B) if not done[b]]
            if not use_draft:
                for b in active:
                    pos = len(prompts[b]) + len(out[b]) - 1
                    o = self.target(torch.tensor([[anchors[b]]], device=dev), position_ids=torch.tensor([[pos]], device=dev),
                                    past_key_values=caches[b], use_cache=True, features=False)
                    caches[b] = o.past_key_values
                    tok = int(_pick(o.logits[0, -1].float(), params, gen))
                    stats.record(commit(b, [tok]))
                    steps[b] += 1
                    anchors[b] = tok
                continue

            # -- draft: one block per row, batched ---------------------------------------------------
            block = torch.full((B, bs), self.mask_token_id, dtype=torch.long, device=dev)
            block[:, 0] = torch.tensor(anchors, device=dev)
            d_logits = self.draft_logits(block, dcache)  # [B, K, V]
            if params.greedy:
                block[:, 1:] = d_logits.argmax(-1)
                p_draft = None
            else:
                p_draft = logits_to_probs(d_logits, params.temperature, params.top_p, params.top_k)
                block[:, 1:] = sample(p_draft, gen)

            # -- verify + accept, row by row ---------------------------------------------------------
            new_feats = torch.zeros(B, bs, kH, device=dev, dtype=pf.dtype)
            counts = torch.zeros(B, dtype=torch.long, device=dev)
            for b in active:
                start = int(dcache.lengths[b])  # position of the anchor
                pos = torch.arange(start, start + bs, device=dev)[None]
                o = self.target(block[b : b + 1], position_ids=pos, past_key_values=caches[b], use_cache=True)
                t_logits = o.logits[0].float()  # [bs, V]
                if params.greedy:
                    a, bonus = greedy_accept(block[b : b + 1, 1:], t_logits.argmax(-1)[None])
                else:
                    p_t = logits_to_probs(t_logits, params.temperature, params.top_p, params.top_k)[None]
                    a, bonus = chain_accept(block[b : b + 1, 1:], p_draft[b : b + 1], p_t, gen)
                a, bonus = int(a), int(bonus)
                n = commit(b, block[b, 1 : a + 1].tolist() + [bonus])
                stats.record(n)
                steps[b] += 1
                # keep the target cache to the committed positions: anchor .. d_a
                caches[b] = o.past_key_values
                self.target.crop_cache(caches[b], start + a + 1)
                new_feats[b, : a + 1] = o.features[0, : a + 1]
                counts[b] = a + 1
                anchors[b] = bonus
            dcache.append(new_feats, counts)

        return GenerationResult(out, reasons, stats, prefill_s, time.perf_counter() - t0, steps)
