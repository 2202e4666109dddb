"""``python -m infer.bench``: acceptance length and throughput on GSM8K, MATH-500, HumanEval, MBPP, MT-Bench.

    python -m infer.bench --target T --draft D --datasets gsm8k,math500,humaneval,mbpp,mt-bench \\
        --num-prompts 80 --max-new-tokens 512 --temperature 0 --concurrency 8 --output-json results/x.json

For each task: the draft run and an autoregressive run of the same engine on the same prompts
(same max tokens and sampling), both after a warm-up of every timed path (docs/method.md §8.16) and,
on a CUDA engine, after an untimed pass of every configuration over the task's own prompts (``--warmup``).
Reports τ (bonus token included), accept_at_pos, tok/s and speedup = spec tok/s ÷ AR tok/s, a
table on stdout, a JSON file (with the command, device, date and commit) and a PNG of the
per-position acceptance. MT-Bench runs both turns; the second turn sees the model's own answer.

Greedy runs compare each draft's output with the AR output of the same engine: in exact mode
(``--exact``, issue 13; both runs exact) they must be identical and any difference is an error
(exit status 1, after the JSON is written); in the fast mode every difference is listed with its
first differing position and the target's top-2 logit margin there (a near-tie: bf16 rounding).
Ctrl-C ends it with exit status 130 (SIGTERM: 143) and writes the finished tasks to the JSON with ``"interrupted":
true`` (beside it, as ``X.interrupted.json``, where ``--overwrite`` would replace a finished file: that file stays); an
error in a later task does the same with its ``"error"`` (exit status 2). Every task's prompts load before the models.
Results never replace a file that was not there at the start (another run's with the same name: this run's go beside
it, ``X.2.json``, with a note), nor an earlier ``X.interrupted.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspine.sampling import SamplingParams, sampling_params
from dspine.stats import AcceptStats
from infer.planner import (
    DRAIN_MODELS,
    PLAN_STATES,
    parse_conf_slope,
    parse_plan_chains,
    parse_plan_trees,
    plan_chains_flag,
    plan_log_path,
    plan_trees_flag,
)

AR_LABEL = "AR"  # the baseline's name in run_order and the JSON (its table row is "(AR)")
MIXED = "mixed"  # --mix: the one task whose prompts are every --datasets task's, taken in turn
# Engine.loop_profile, summed per task in the JSON (admit_device_s: CUDA only, the admissions' device time; admits:
# how many admissions; steps: the decode loop's steps, one per step of the whole batch)
PROFILE_KEYS = ("prefill_s", "launch_s", "wait_s", "host_s", "admit_device_s", "admits", "steps")
# StepPlanner.report's counts, summed over a task's calls (Runner.planner_steps); step_ms, measured_ms and
# conf_slope (StepPlanner.slope) are the latest call's
PLANNER_SUMS = {"steps": 0, "drain_steps": 0, "paired": 0, "observed": 0, "realized_tokens": 0.0, "timed_steps": 0,
                "timed_ms": 0.0}


def parse_drafts(values: list[str] | None) -> dict[str, str]:
    """``[LABEL=]PATH`` items -> {label: path} (label defaults to the folder name).

    Raises ValueError for a label given twice or one that names the AR baseline."""
    out: dict[str, str] = {}
    for v in values or []:
        label, _, path = v.rpartition("=") if "=" in v else ("", "", v)
        label = label or Path(path).name
        if label in out:
            raise ValueError(f"--draft label {label!r} given twice")
        if label in (AR_LABEL, f"({AR_LABEL})"):
            raise ValueError(f"--draft {v}: the label {label!r} names the autoregressive baseline; give another "
                             "one (--draft LABEL=PATH)")
        out[label] = path
    return out


def _choice(key: str, values: dict, expected: str):
    """A ``--config`` value parser: ``values[text]``, or ValueError ``KEY='TEXT'; expected ...``."""
    def parse(text: str):
        if text not in values:
            raise ValueError(f"{key}={text!r}; expected {expected}")
        return values[text]
    return parse


def _tree_budget(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text):  # plain digits, as width= (int() takes "1_6" and " 16")
        raise ValueError(f"tree_budget={text!r} is not an integer")
    return int(text)


def _width(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or not 2 <= int(text) <= 64:
        raise ValueError(f"width={text!r}; expected a chain width (anchor included) in 2..64")
    return int(text)


def _draft_vocab(text: str) -> str | None:  # a file (read with the models), or none: the whole vocabulary
    if not text:
        raise ValueError("draft_vocab= needs a file path or none")
    return None if text == "none" else text


CONFIDENCE = ("greedy", "always", "never")  # Engine.plan_confidence
DRAIN = ("off", *DRAIN_MODELS)  # off: Engine.plan_drain False; else on with that Engine.plan_drain_model
# --config KEY -> its value parser (ValueError naming KEY and the value)
CONFIG_PARSERS = {
    "verify": _choice("verify", {"chain": "chain", "tree": "tree"}, "chain or tree"),
    "tree_budget": _tree_budget,
    "budget": _choice("budget", {"auto": "auto", "none": None}, "auto or none"),
    "chain_first": _choice("chain_first", {"auto": None, "yes": True, "no": False}, "auto, yes or no"),  # Engine's
    "plan_trees": parse_plan_trees,
    "plan_chains": parse_plan_chains,
    "width": _width,  # a fixed chain narrower than the draft's block (Engine's verify_size for this label)
    "confidence": _choice("confidence", {c: c for c in CONFIDENCE}, ", ".join(CONFIDENCE)),
    "conf_slope": parse_conf_slope,
    "drain": _choice("drain", {d: d for d in DRAIN}, ", ".join(DRAIN)),
    "state": _choice("state", {x: x for x in PLAN_STATES}, ", ".join(PLAN_STATES)),
    "draft_vocab": _draft_vocab,
}
CONFIG_KEYS = tuple(CONFIG_PARSERS)


def parse_configs(values: list[str] | None, labels, args, tree_budget_given: bool | None = None) -> dict[str, dict]:
    """``--config LABEL:KEY=VALUE[,KEY=VALUE]`` items -> {label: {"verify", "tree_budget", "budget", "chain_first",
    "plan_trees", "confidence", "conf_slope", "drain", "state", "draft_vocab"}}, one entry per draft label: the run-wide ``--verify`` / ``--tree-budget`` /
    ``--budget`` with the label's overrides. So one run can time several verify modes of one draft (``--draft chain=D --draft auto=D
    --config auto:budget=auto``), alternated per task like any drafts.

    Raises ValueError naming the item: an unknown label or key, a bad value, a label given twice, a tree
    budget under budget=auto (the planner's sizes are plan_trees), a tree budget without tree verify, and the
    run-wide rules (a tree needs a draft temperature above 0, the reference backend has neither trees under a
    budget nor the planner). ``tree_budget_given``: whether ``--tree-budget`` was on the command line, before
    check_decode_args filled in its default (None: ``args.tree_budget is not None``); a given one under a label's
    budget=auto is refused, a default one is dropped there (the planner runs its own trees, plan_trees)."""
    if tree_budget_given is None:
        tree_budget_given = args.tree_budget is not None
    base = {"verify": args.verify, "tree_budget": args.tree_budget, "budget": args.budget, "chain_first": None,
            "plan_trees": None, "plan_chains": None, "width": None, "confidence": None, "conf_slope": None, "drain": None,
            "state": None, "draft_vocab": getattr(args, "draft_vocab", None)}
    out = {label: dict(base) for label in labels}
    seen = set()
    for item in values or []:
        label, sep, rest = item.rpartition(":")  # a label may hold ':'; keys and values never do
        if not sep or not rest:
            raise ValueError(f"--config {item!r}: give LABEL:KEY=VALUE[,KEY=VALUE] (keys {', '.join(CONFIG_KEYS)})")
        if label not in out:
            hint = ("; a draft_vocab path that holds ':' or ',' cannot go in --config: give it run-wide with --draft-vocab"
                    if "draft_vocab=" in label else "")
            raise ValueError(f"--config {item!r}: {label!r} is not a --draft label (labels: {', '.join(out) or 'none'})"
                             + hint)
        if label in seen:
            raise ValueError(f"--config {item!r}: label {label!r} given twice (put its keys in one --config)")
        seen.add(label)
        given = {}
        prev = None
        for kv in rest.split(","):
            key, eq, value = kv.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in CONFIG_KEYS:
                hint = ("; a draft_vocab path that holds ',' cannot go in --config: give it run-wide with --draft-vocab"
                        if prev == "draft_vocab" else "")
                raise ValueError(f"--config {item!r}: {kv!r} is not KEY=VALUE with a key of {', '.join(CONFIG_KEYS)}"
                                 + hint)
            prev = key
            if key in given:
                raise ValueError(f"--config {item!r}: key {key!r} given twice")
            given[key] = value.strip()
        c = out[label]
        for key in sorted(given, key=lambda k: (k == "tree_budget", CONFIG_KEYS.index(k))):  # tree_budget last
            try:
                c[key] = CONFIG_PARSERS[key](given[key])
            except ValueError as e:
                raise ValueError(f"--config {item!r}: {e}") from None
        if given.get("verify") == "chain" and "tree_budget" not in given:
            c["tree_budget"] = None
        if c["verify"] == "tree":
            c["tree_budget"] = 32 if c["tree_budget"] is None else c["tree_budget"]
            if not 2 <= c["tree_budget"] <= 64:
                raise ValueError(f"--config {item!r}: tree_budget={c['tree_budget']} must be in 2..64")
        elif c["tree_budget"] is not None:
            raise ValueError(f"--config {item!r}: tree_budget applies to verify=tree only")
        if "tree_budget" in given and c["budget"] is not None:
            raise ValueError(f"--config {item!r}: tree_budget with budget=auto: the planner picks its own tree sizes "
                             f"(give them with --config {label}:plan_trees=16/32)")
    wide_chains = getattr(args, "plan_chains", None)  # the run-wide --plan-chains: budget=auto labels without their own
    if wide_chains is not None:
        chains = plan_chains_flag(wide_chains)
        takers = [c for c in out.values() if c["budget"] is not None and c["plan_chains"] is None]
        if not takers:
            raise ValueError(f"--plan-chains {wide_chains}: applies to budget=auto labels without their own "
                             "plan_chains (none here)")
        for c in takers:
            c["plan_chains"] = chains
    wide = getattr(args, "plan_trees", None)  # the run-wide --plan-trees: every budget=auto label without its own
    if wide is not None:
        wide_trees = plan_trees_flag(wide)
        if not any(c["budget"] for c in out.values()):
            raise ValueError(f"--plan-trees {wide}: applies to --budget auto only (no configuration has it)")
        takers = [c for c in out.values() if c["budget"] is not None and c["plan_trees"] is None]
        if not takers:
            raise ValueError(f"--plan-trees {wide}: every budget=auto label gives its own plan_trees in --config, so "
                             "it would apply to none (drop it or one label's plan_trees)")
        for c in takers:
            c["plan_trees"] = wide_trees
    for label, c in out.items():
        if c["budget"] is not None and c["tree_budget"] is not None:  # the run-wide one: a label's own is refused above
            if tree_budget_given:
                raise ValueError(f"draft {label!r}: --tree-budget {args.tree_budget} with budget=auto: the planner "
                                 f"picks its own tree sizes (give them with --config {label}:plan_trees=16/32, or "
                                 "drop --tree-budget)")
            c["tree_budget"] = None  # a default the planner never ran: the JSON records what ran
        if c["verify"] == "tree" and c["budget"] is None and getattr(args, "draft_temperature", None) == 0:
            raise ValueError(f"draft {label!r}: --draft-temperature 0 with verify=tree (the tree is built from the "
                             "draft's distribution, one-hot at 0)")
        if c["plan_trees"] and getattr(args, "draft_temperature", None) == 0 and args.temperature > 0:
            raise ValueError(f"draft {label!r}: plan_trees with --draft-temperature 0 (the planner runs no tree from a "
                             "one-hot draft)")
        if getattr(args, "invariant", False) and args.temperature > 0:
            if c["verify"] == "tree":
                raise ValueError(f"draft {label!r}: --invariant with verify=tree (invariant verification checks the "
                                 "chain only; with budget=auto the planner runs no tree)")
            if c["plan_trees"]:
                raise ValueError(f"draft {label!r}: plan_trees with --invariant (the planner runs no tree under "
                                 "invariant verification)")
        if c["chain_first"] is not None and c["verify"] != "tree" and c["budget"] is None:
            raise ValueError(f"draft {label!r}: chain_first applies to verify=tree or budget=auto (this label verifies "
                             "the chain only)")
        if c["width"] is not None and (c["verify"] != "chain" or c["budget"] is not None):
            raise ValueError(f"draft {label!r}: width applies to a fixed chain (verify=chain, no budget=auto; the "
                             "planner's narrower chains are plan_chains)")
        if c["width"] is not None and args.backend == "reference":
            raise ValueError(f"draft {label!r}: width applies to the engine (the reference backend takes --block-size)")
        for key, what in (("plan_trees", "the planner's tree sizes"), ("plan_chains", "the planner's narrower chains"),
                          ("confidence", "when the planner gets the draft's confidence"),
                          ("conf_slope", "how far the planner moves an estimate with the draft's confidence"),
                          ("drain", "the planner's drain rule"), ("state", "the planner's state")):
            if c[key] is not None and c["budget"] is None:
                raise ValueError(f"draft {label!r}: {key} applies to budget=auto ({what})")
        if c["conf_slope"] is not None and (c["confidence"] == "never" or (
                getattr(args, "temperature", 0.0) > 0 and c["confidence"] != "always")):
            raise ValueError(f"draft {label!r}: conf_slope with confidence={c['confidence'] or 'greedy'} at --temperature "
                             f"{getattr(args, 'temperature', 0.0)} (the planner gets no confidence to scale by; at T > 0 "
                             "only with confidence=always)")
        if c["chain_first"] is not None and args.backend == "reference":
            raise ValueError(f"draft {label!r}: chain_first applies to the engine (the reference backend builds its "
                             "trees best first at T = 0, the chain first at T > 0)")
        if c["chain_first"] is False and getattr(args, "temperature", 0.0) > 0:
            raise ValueError(f"draft {label!r}: chain_first=no at --temperature {args.temperature} (the tree's "
                             "rejection sampling needs the sampled chain in every tree)")
        if c["budget"] is not None and args.backend == "reference":
            raise ValueError(f"draft {label!r}: budget=auto needs the engine (--backend cuda; --device cpu on a CPU)")
    return out


class Runner:
    """The target once, every draft beside it: ``run(prompts, params, draft_label or None)``."""

    def __init__(self, args):
        from dspine.paths import load_tokenizer, resolve_model_path
        from dspine.target import TargetSpec, assert_compatible

        self.args = args
        # this invocation's id in every DSPINE_PLAN_LOG record's tag ("run"): a log appended to by several runs is read
        # one run at a time (benchmarks/engine/plan_log.py --run)
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"
        self.drafts = parse_drafts(args.draft)
        # per draft label: verify / tree_budget / budget (check_args fills it; the run-wide flags otherwise)
        self.configs = getattr(args, "configs", None) or parse_configs(getattr(args, "config", None), self.drafts,
                                                                        args)
        if getattr(args, "plan_drain", None) is not None and not any(c["budget"] for c in self.configs.values()):
            raise ValueError("--plan-drain / --no-plan-drain apply to --budget auto only (no configuration has it)")
        path, gguf = resolve_model_path(args.target, args.gguf_file)
        self.spec = TargetSpec.from_pretrained(path, gguf)
        self.backend = args.backend if args.backend != "auto" else ("cuda" if torch.cuda.is_available() else "reference")
        if args.backend == "auto" and self.backend == "cuda" and self.spec.engine_layer_problems \
                and not self.spec.layer_problems:
            print(f"note: {'; '.join(self.spec.engine_layer_problems)}: not in the engine; --backend auto uses the "
                  "reference backend", file=sys.stderr)
            self.backend = "reference"
        self.spec.check_supported(engine=self.backend == "cuda")
        if self.backend != "cuda" and getattr(args, "config", None):  # --backend auto without a GPU: never dropped
            raise ValueError(f"--config needs the engine, and this run uses the {self.backend} backend "
                             "(--backend auto without a CUDA GPU, or a target the engine does not run); give "
                             "--backend cuda (--device cpu on a CPU)")
        if args.exact is None:  # the engine's default; the reference backend has no exact mode
            from infer.model import EXACT_DEFAULT

            args.exact = EXACT_DEFAULT and self.backend == "cuda"
        self.tokenizer = load_tokenizer(path, gguf)
        self.eos = sorted(self.spec.eos_ids)
        limit = self.spec.max_position_embeddings
        if limit and args.max_prompt_tokens + args.max_new_tokens + 64 > limit:
            # keep the end of long prompts so that prompt + new tokens fit the target's context
            args.max_prompt_tokens = limit - args.max_new_tokens - 64
            if args.max_prompt_tokens < 16:
                raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                                 f"target's context of {limit} positions (a prompt of at least 16 tokens and 64 "
                                 f"positions of headroom for the draft's block: give at most {limit - 80})")
        max_seq = args.max_prompt_tokens + args.max_new_tokens + 64
        from dspine.checkpoint import load_draft

        models = {}
        for label, dpath in self.drafts.items():
            models[label] = load_draft(dpath, dtype=torch.float32)
            assert_compatible(self.spec, models[label].config, max_context=max_seq - 64)
        self.block_size = {label: m.config.block_size for label, m in models.items()}
        for label, c in self.configs.items():  # before the target's weights load
            bs = self.block_size[label]
            if args.block_size is not None and args.block_size > bs:  # (below 2: refused by check_decode_args)
                raise ValueError(f"--block-size {args.block_size}: must be in 2..{bs} (draft {label!r}'s block size)")
            if c["width"] is not None and c["width"] >= bs:
                raise ValueError(f"--config {label}:width={c['width']}: a fixed chain's width must be below the draft's "
                                 f"block of {bs} (the label without width verifies the whole block)")
            wide = args.block_size or bs  # the planner's full chain
            if c["plan_chains"] and max(c["plan_chains"]) >= wide:
                raise ValueError(f"draft {label!r}: plan_chains {'/'.join(map(str, c['plan_chains']))} (--config "
                                 f"{label}:plan_chains= or --plan-chains): each width must be below the planner's full "
                                 f"chain of {wide}")
            if (c["budget"] == "auto" and args.block_size is not None and args.block_size != self.block_size[label]
                    and c["plan_trees"] != () and self.backend == "cuda"):
                how = "--budget auto" if args.budget == "auto" else f"--config {label}:budget=auto"
                raise ValueError(f"--block-size {args.block_size} with the planner of label {label} ({how}): its trees "
                                 f"verify the draft's whole block of {self.block_size[label]}; add --config "
                                 f"{label}:plan_trees=none (AR and a chain of {args.block_size}) or drop --block-size")
        # per label: the draft vocabulary's ids, and its {"path", "size", "coverage"} for the JSON (None: the whole
        # vocabulary); each file is read once
        from dspine.draft_vocab import check_tokens, describe, load_draft_vocab, unchecked_note

        loaded = {}
        for flag, f in vocab_flags(getattr(args, "draft_vocab", None), self.configs).items():  # the run-wide one too
            try:
                loaded[f] = load_draft_vocab(f, self.spec.vocab_size)
                check_tokens(f, *loaded[f], self.tokenizer)
            except (ValueError, FileNotFoundError) as e:
                raise type(e)(f"{flag}: {e}") from None
            if note := unchecked_note(f, loaded[f][1]):
                print(f"note: {flag}: {note}", file=sys.stderr)
        self.vocab_ids = {label: loaded[c["draft_vocab"]][0] if c["draft_vocab"] else None
                          for label, c in self.configs.items()}
        self.vocab_info = {label: describe(c["draft_vocab"], *loaded[c["draft_vocab"]]) if c["draft_vocab"] else None
                           for label, c in self.configs.items()}
        self.decoders = {}
        # label -> mode -> {"steps", "drain_steps", "paired", "observed", "realized_tokens" (summed over the task's calls),
        # "step_ms", "measured_ms", "conf_slope" (the latest call's)}: StepPlanner.report (--budget auto)
        self.planner_steps: dict = {}
        if self.backend == "cuda":
            from dspine.reference import TREE_BUDGET  # Engine's size under verify=tree; unused by budget=auto
            from infer.engine import Engine
            from infer.generate import ENGINE_DTYPES
            from infer.model import EngineTarget

            dtype = ENGINE_DTYPES[args.dtype]
            layer_ids = sorted({i for m in models.values() for i in m.config.target_layer_ids})
            impl = "triton" if torch.device(args.device).type == "cuda" else "torch"
            target = EngineTarget.from_pretrained(path, gguf, device=args.device, dtype=dtype, layer_ids=layer_ids,
                                                  impl=impl)
            # caches for the largest batch a task runs (main: --concurrency, or fewer when no task has as many prompts)
            kw = dict(max_batch=getattr(args, "max_batch", None) or args.concurrency, max_seq=max_seq,
                      max_new_cap=args.max_new_tokens, exact=args.exact, prefill_buckets=args.prefill_buckets)
            self.decoders[None] = Engine(target, None, self.eos, **kw)
            args.prefill_buckets = self.decoders[None].prefill_buckets  # the resolved value, for the JSON
            for label, m in models.items():
                # each draft reads its own layers: the target returns them in the draft's order
                c = self.configs[label]
                # --block-size: the chain labels' width; a label's own width= (a narrower fixed chain) before it
                vs = (c["width"] or args.block_size) if c["verify"] == "chain" else None
                self.decoders[label] = Engine(target, m, self.eos, verify_size=vs, verify=c["verify"],
                                              tree_budget=c["tree_budget"] or TREE_BUDGET, budget=c["budget"],
                                              tree_chain_first=c["chain_first"], plan_trees=c["plan_trees"],
                                              plan_chains=c["plan_chains"],
                                              draft_vocab=self.vocab_ids[label], **kw)
                self.decoders[label].plan_drain = (args.plan_drain is not False if c.get("drain") is None
                                                   else c["drain"] != "off")
                if c.get("drain") not in (None, "off"):
                    self.decoders[label].plan_drain_model = c["drain"]
                for key in ("confidence", "conf_slope", "state"):  # Engine.plan_confidence, ...
                    if c.get(key) is not None:
                        setattr(self.decoders[label], f"plan_{key}", c[key])
            self._layer_ids = {label: (m.config.target_layer_ids, m.config.last_layer_features)
                               for label, m in models.items()}
        else:
            from dspine.reference import ReferenceDecoder, reference_verify_size
            from dspine.target import load_target

            args.block_size = reference_verify_size(args.block_size, args.verify, self.block_size.values())
            refuse_engine_options(args)
            target = load_target(path, gguf, dtype="fp32" if args.dtype == "auto" else args.dtype)
            self.decoders[None] = ReferenceDecoder(target, None, self.eos)
            for label, m in models.items():
                self.decoders[label] = ReferenceDecoder(target, m.to(target.dtype), self.eos, verify=args.verify,
                                                        tree_budget=args.tree_budget, verify_size=args.block_size,
                                                        draft_vocab=self.vocab_ids[label])
        # target positions verified per step and request (anchor included)
        self.verified_per_step = {label: "auto" if c["budget"] else c["tree_budget"] if c["verify"] == "tree"
                                  else (c["width"] or args.block_size or self.block_size[label])
                                  for label, c in self.configs.items()}

    def capture_prefill(self, batch: int) -> None:
        """Make every prefill graph that admissions of up to ``--max-prompt-tokens`` tokens into ``batch`` slots
        could need, for every configuration, before any timing (``Engine.capture_prefill``: MT-Bench's second-turn
        prompts hold each configuration's own first answer, so their length buckets differ between configurations
        and passes); graphs already made are kept. No-op off the engine."""
        if self.backend != "cuda":
            return
        for label, dec in self.decoders.items():
            dec.target.layer_ids, dec.target.last_layer_features = (self._layer_ids[label] if label
                                                                     else ([], "post_norm"))  # as run() sets them
            dec.capture_prefill(batch, self.args.max_prompt_tokens, use_draft=label is not None)

    @torch.inference_mode()
    def top2(self, ids: list[int]) -> tuple[float, list[int]]:
        """(top-1 − top-2 logit, [top-1, top-2] ids) of the target after ``ids``, one prefill pass in the
        run's dtype (the engine's target on the cuda backend)."""
        dec = self.decoders[None]
        if self.backend == "cuda":
            t = dec.target
            logits, _ = t.prefill(torch.tensor(ids, device=t.embed.device), 0, t.new_cache(1, len(ids)),
                                  want_features=False)
        else:
            logits = dec.target(torch.tensor([ids], device=dec.target.device), features=False).logits[0, -1]
        top = logits.float().topk(2)
        return float(top.values[0] - top.values[1]), top.indices.tolist()

    def planner_memory(self, label: str | None, memory: dict | None = None) -> dict | None:
        """The acceptance memory of configuration ``label``'s planner (``Engine.plan_token_memory``, a copy),
        or with ``memory`` set it back to that copy; None off the engine."""
        import copy

        dec = self.decoders[label]
        if not hasattr(dec, "plan_token_memory"):
            return None
        if memory is None:
            return copy.deepcopy(dec.plan_token_memory)
        dec.plan_token_memory = memory
        return memory

    def run(self, prompts: list[list[int]], params: SamplingParams, label: str | None, tag: dict | None = None):
        """Decode ``prompts`` with configuration ``label`` (None: AR) -> (tokens, stats, seconds, verify steps
        per prompt, profile): on the engine ``profile`` holds the call's seconds in prefill and in the
        decode loop's launches, device waits and host work (``Engine.loop_profile``); {} otherwise. ``tag``: what
        the call is (label, task, turn, pass), written into a ``DSPINE_PLAN_LOG`` line (``Engine.plan_log_tag``) with
        this invocation's ``run`` id (:attr:`run_id`, UTC start time and process id)."""
        dec = self.decoders[label]
        if self.backend == "cuda":
            dec.plan_log_tag = {"label": AR_LABEL if label is None else label, **(tag or {}), "run": self.run_id}
            dec.target.layer_ids, dec.target.last_layer_features = self._layer_ids[label] if label else ([], "post_norm")
            r = dec.generate(prompts, params, concurrency=self.args.concurrency, use_draft=label is not None)
            if dec.planner_report is not None:  # the planner's choices, summed over the task's calls
                for mode, e in dec.planner_report.items():
                    tot = self.planner_steps.setdefault(label, {}).setdefault(mode, dict(PLANNER_SUMS))
                    tot.update({k: tot[k] + e[k] for k in PLANNER_SUMS}, step_ms=e["step_ms"],
                               measured_ms=e["measured_ms"], conf_slope=e["conf_slope"])  # the latest call's
            prof = {k: dec.loop_profile.get(k, 0.0) for k in PROFILE_KEYS}
            return r.token_ids, r.stats, r.elapsed_s, list(r.steps_per_prompt), prof
        if label is not None:
            dec.target.set_layer_ids(dec.draft.config.target_layer_ids, dec.draft.config.last_layer_features)
        tokens, stats, secs, steps = [], None, 0.0, []
        for i in range(0, len(prompts), self.args.concurrency):  # fixed-size batches
            r = dec.generate(prompts[i : i + self.args.concurrency], params)
            tokens += r.token_ids
            stats = r.stats if stats is None else stats.merge(r.stats)
            secs += r.elapsed_s
            steps += list(r.steps_per_prompt)
        return tokens, stats, secs, steps, {}


def encode(runner: Runner, text: str, history=None) -> list[int]:
    from dspine.prompts import encode_prompt

    ids = encode_prompt(runner.tokenizer, text, chat=not runner.args.no_chat_template, system=runner.args.system,
                        enable_thinking=runner.args.enable_thinking, history=history)
    if len(ids) > runner.args.max_prompt_tokens:
        ids = ids[-runner.args.max_prompt_tokens :]  # keep the end: the question and the assistant header
    return ids


def bootstrap_ci(committed: list[int], steps: list[int], n: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of τ = Σ committed / Σ steps, resampling prompts with replacement.

    committed[i] / steps[i]: verify-step tokens and verify steps of prompt i (prompts without a verify
    step carry no weight). Returns [low, high]; [τ, τ] for a single prompt (Efron & Tibshirani 1993, §13);
    [nan, nan] without a verify step. :func:`mean_tau_ci` of one task, the same resamples."""
    if len(committed) == 0 or sum(steps) == 0:
        return [float("nan"), float("nan")]
    return mean_tau_ci([{"per_prompt_committed": committed, "per_prompt_steps": steps}], n, seed)


def run_task(runner: Runner, task: str, params: SamplingParams, do_ar: bool, order_shift: int = 0,
             warmup: bool = False, items: list | None = None) -> dict:
    """One task: AR (unless ``do_ar`` is False) and every draft on the same prompts.

    The run order rotates by ``order_shift`` (the task's index), so no configuration always runs
    first or last (clock and thermal drift are spread over all of them). ``warmup``: first decode the
    task once with every configuration, untimed and discarded, then time a second pass (``--warmup
    task``): on the H200 the first configuration to decode a task's prompts ran up to 2x slower than a
    later one with equal τ (the README's kv-continuation run, results/smollm2-h200-kvcont-T0-c8*.json), a
    one-time cost that the start-up warm-up (short prompts, 32 tokens) does not cover. ``items``: the task's
    prompts (:func:`load_tasks`; None: loaded here)."""
    if items is None:
        items = load_tasks(runner.args, [task])[task]
    if task != MIXED and len(items) < runner.args.num_prompts:
        print(f"note: {task} has {len(items)} prompts; --num-prompts {runner.args.num_prompts} runs all {len(items)}",
              file=sys.stderr)
    out: dict = {"task": task, "num_prompts": len(items), "drafts": {},
                 **({"mixed_tasks": [x.task for x in items]} if task == MIXED else {})}
    runner.capture_prefill(min(runner.args.concurrency, len(items)))  # before any pass, at the task's batch size
    labels = ([None] if do_ar or not runner.drafts else []) + list(runner.drafts)
    shift = order_shift % len(labels)
    labels = labels[shift:] + labels[:shift]
    out["run_order"] = [AR_LABEL if x is None else x for x in labels]
    outputs = {}

    def decode(label, phase):
        """Every turn of every prompt with configuration ``label``: (prompts, tokens, stats, seconds,
        tokens counted, committed per prompt, verify steps per prompt, profile summed over the turns). Python's
        garbage collector runs before the pass and is off during it: the harness keeps every output, and a full
        collection inside a timed decode is a host stall of the configuration that happens to trigger it (issue 16:
        one planner pass at concurrency 64 spent 0.26 s launching steps where the other tasks spent 0.01-0.06 s)."""
        gc.collect()
        gc.disable()
        try:
            histories = [[] for _ in items]
            all_tokens, all_prompts, stats, secs, n_tok, prof = [], [], None, 0.0, 0, {}
            per_committed, per_steps = [0] * len(items), [0] * len(items)
            for turn in range(max(len(x.turns) for x in items)):
                idx = [i for i, x in enumerate(items) if turn < len(x.turns)]
                prompts = [encode(runner, items[i].turns[turn], histories[i]) for i in idx]
                tokens, st, s, steps, p = runner.run(prompts, params, label, {"task": task, "turn": turn, "pass": phase})
                prof = {k: prof.get(k, 0.0) + v for k, v in p.items()}
                for i, toks, n_steps in zip(idx, tokens, steps):
                    text = runner.tokenizer.decode([t for t in toks if t not in runner.spec.eos_ids], skip_special_tokens=True)
                    histories[i] += [{"role": "user", "content": items[i].turns[turn]}, {"role": "assistant", "content": text}]
                    per_committed[i] += max(len(toks) - 1, 0)  # the first token comes from the prefill
                    per_steps[i] += n_steps
                all_tokens += tokens
                all_prompts += prompts
                stats = st if stats is None else stats.merge(st)
                secs += s
                n_tok += sum(len(t) for t in tokens)
            return all_prompts, all_tokens, stats, secs, n_tok, per_committed, per_steps, prof
        finally:
            gc.enable()

    warm: dict = {}  # label -> (seconds, profile) of the untimed pass
    if warmup:
        for label in labels:
            # the planner's acceptance memory as it was before this task (infer.planner, "Across calls"): the
            # timed pass must not learn from its own prompts; the step-time model it learned is kept
            memory = runner.planner_memory(label)
            r = decode(label, "warmup")
            runner.planner_memory(label, memory)
            warm[label] = (r[3], r[7])
            runner.planner_steps.pop(label, None)  # the planner's choices of the timed pass only
    for label in labels:
        all_prompts, all_tokens, stats, secs, n_tok, per_committed, per_steps, prof = decode(label, "timed")
        row = {"tok_per_s": n_tok / secs, "num_tokens": n_tok, "seconds": secs, **stats.to_dict()}
        if prof:
            row["profile"] = prof
        if label in warm:  # what the one-time costs were: the untimed pass against the timed one
            row["warmup_seconds"] = warm[label][0]
            if warm[label][1]:
                row["warmup_profile"] = warm[label][1]
        if label is not None:
            row["tau_ci95"] = bootstrap_ci(per_committed, per_steps)
            c = runner.configs[label]
            row["verify"], row["verified_tokens_per_step"] = c["verify"], runner.verified_per_step[label]
            row["draft_vocab"] = runner.vocab_info[label]
            if c["verify"] == "tree" or c["budget"] is not None:  # the rule in force
                row["tree_chain_first"] = runner.decoders[label].chain_first(params)
            if c["budget"] is not None:
                dec = runner.decoders[label]
                row.update(budget=c["budget"], plan_trees=list(dec.plan_trees), plan_chains=list(dec.plan_chains),
                           plan_confidence=dec.plan_confidence, plan_conf_slope=dec.plan_conf_slope,
                           plan_state=dec.plan_state,
                           plan_drain=dec.plan_drain_model if dec.plan_drain else "off")
            if label in runner.planner_steps:
                row["planner_choices"] = runner.planner_steps.pop(label)
            row["per_prompt_committed"], row["per_prompt_steps"] = per_committed, per_steps
        outputs[label] = (all_prompts, all_tokens)
        if label is None:
            out["ar"] = row
        else:
            out["drafts"][label] = row
    for label, row in out["drafts"].items():
        if "ar" in out:  # None without a verify step (every output ended at its prefill token): the draft never ran,
            # so the ratio of the two runs' times would be noise (as infer.generate --compare-ar)
            row["speedup"] = row["tok_per_s"] / out["ar"]["tok_per_s"] if row.get("verify_steps") else None
            if params.greedy or params.invariant_sampling:  # the same text as AR is the contract: check it
                ar_prompts, ar_tokens = outputs[None]
                prompts, tokens = outputs[label]
                # later turns see the model's own first answer, so compare only identical prompts
                pairs = [(p, a, b) for p, q, a, b in zip(prompts, ar_prompts, tokens, ar_tokens) if p == q]
                row["greedy_compared"] = len(pairs)
                row["greedy_equal"] = sum(a == b for _, a, b in pairs)
                row["greedy_mismatches"] = []
                for p, a, b in pairs:
                    if a != b:
                        i = first_divergence(a, b)
                        m = {"prompt_ids": p, "draft_tokens": a, "ar_tokens": b, "position": i}
                        if i < len(b):  # the target's near-tie there (None: one output ends earlier)
                            m["ar_top2_margin"], m["ar_top2"] = runner.top2(p + b[:i])
                        row["greedy_mismatches"].append(m)
                row["exact"] = bool(runner.args.exact)
    return out


def load_tasks(args, tasks: list[str]) -> dict[str, list]:
    """{task: its prompts} of every task (``MIXED``: the ``args.mix_tasks`` prompts taken in turn), loaded before any
    model so that a task whose eval file is missing fails at once, not after the tasks before it ran. Raises
    FileNotFoundError / ValueError as ``infer.datasets.load_eval_prompts``."""
    from infer.datasets import interleave, load_eval_prompts

    load = lambda t: load_eval_prompts(t, args.num_prompts, args.data_dir)
    return {t: interleave([load(x) for x in getattr(args, "mix_tasks", None) or []]) if t == MIXED else load(t)
            for t in tasks}


def first_divergence(a: list[int], b: list[int]) -> int:
    """First index where token lists ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def table(rows: list[dict]) -> str:
    """One line per (task, draft); "-" where a value does not exist (no AR baseline with --no-ar: no
    speedup; the AR row has no τ)."""
    head = (f"{'task':<10} {'draft':<14} {'tau':>6} {'acc@1':>6} {'acc@4':>6} {'acc@8':>6} {'tok/s':>9} "
            f"{'AR tok/s':>9} {'speedup':>8}")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [head, "-" * len(head)]
    for r in rows:
        ar = r.get("ar", {}).get("tok_per_s")
        entries = list(r["drafts"].items()) or [("(AR)", {"tok_per_s": ar})]
        for label, d in entries:
            acc = d.get("accept_at_pos", [])
            at = lambda k, acc=acc: f"{acc[k - 1]:.3f}" if len(acc) >= k else "-"
            lines.append(f"{r['task']:<10} {label:<14} {fmt(d.get('tau'), '.2f'):>6} {at(1):>6} {at(4):>6} {at(8):>6} "
                         f"{fmt(d.get('tok_per_s'), '.1f'):>9} {fmt(ar, '.1f'):>9} {fmt(d.get('speedup'), '.2f'):>8}")
    return "\n".join(lines)


def summarize(rows: list[dict]) -> dict:
    """Per draft: mean τ over tasks, τ pooled over all steps, mean speedup.

    A task in which the draft made no verify step (every output ended at its first token, e.g.
    ``--max-new-tokens 1`` or an immediate EOS) has no τ and no speedup (``None``): it is left out of ``mean_tau``,
    its interval and ``mean_speedup``, and counted in ``tasks_without_steps``; each mean is None when no task has a
    step."""
    out: dict = {}
    labels = sorted({label for r in rows for label in r["drafts"]})
    for label in labels:
        ds = [r["drafts"][label] for r in rows if label in r["drafts"]]
        hist = [sum(x) for x in zip(*(d["accept_hist"] for d in ds))]
        stepped = [d for d in ds if d.get("tau") is not None]
        pooled = AcceptStats(len(hist), [0] + hist)
        entry = {"mean_tau": sum(d["tau"] for d in stepped) / len(stepped) if stepped else None,
                 "pooled_tau": pooled.tau if pooled.steps else None}
        if len(stepped) < len(ds):
            entry["tasks_without_steps"] = len(ds) - len(stepped)
        if stepped and all("per_prompt_steps" in d for d in stepped):
            entry["mean_tau_ci95"] = mean_tau_ci(stepped)
        if all("speedup" in d for d in ds):  # over the tasks with a verify step, as mean_tau
            sp = [d["speedup"] for d in ds if d["speedup"] is not None]
            entry["mean_speedup"] = sum(sp) / len(sp) if sp else None
        if all("greedy_compared" in d for d in ds):
            entry["greedy_equal"] = sum(d["greedy_equal"] for d in ds)
            entry["greedy_compared"] = sum(d["greedy_compared"] for d in ds)
        out[label] = entry
    return out


def task_bootstrap(counts: list[tuple[torch.Tensor, torch.Tensor]], n: int = 2000,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over tasks of τ for D drafts decoded on the same prompts, and n bootstrap resamples of it.

    ``counts``: per task, (committed, steps) float64 ``[D, P]`` (P prompts of that task; a task's τ =
    Σ committed / Σ steps). Returns (``[D]``, ``[n, D]``): prompts are resampled with replacement within
    each task, with the same indices for every draft, so in a difference of drafts the prompt-to-prompt
    spread they share cancels (a paired bootstrap; Efron & Tibshirani 1993, §13)."""
    g = torch.Generator().manual_seed(seed)
    point = boot = 0
    for c, s in counts:
        i = torch.randint(0, c.shape[1], (n, c.shape[1]), generator=g)  # [n, P]
        point = point + c.sum(-1) / s.sum(-1).clamp(min=1)
        boot = boot + (c[:, i].sum(-1) / s[:, i].sum(-1).clamp(min=1)).T
    return point / len(counts), boot / len(counts)


def mean_tau_ci(draft_rows: list[dict], n: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the mean over tasks of τ: prompts resampled within each task."""
    counts = [tuple(torch.tensor([d[k]], dtype=torch.float64) for k in ("per_prompt_committed", "per_prompt_steps"))
              for d in draft_rows]
    means = task_bootstrap(counts, n, seed)[1][:, 0]
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [lo, hi]


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[infer]'): no plot written", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({label for r in rows for label in r["drafts"]})
    fig, axes = plt.subplots(1, max(1, len(labels)), figsize=(6 * max(1, len(labels)), 4), squeeze=False)
    for ax, label in zip(axes[0], labels):
        for r in rows:
            if label in r["drafts"]:
                d = r["drafts"][label]
                acc = d["accept_at_pos"]
                tau = "n/a" if d.get("tau") is None else f"{d['tau']:.2f}"
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['task']} (τ={tau})")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("accept_at_pos[k]: steps with ≥ k accepted")
        ax.set_ylim(0, 1)
        ax.set_title(f"{label} — {title}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser():
    from infer.datasets import TASKS
    from infer.generate import add_decode_args

    ap = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--draft", action="append", default=None, metavar="[LABEL=]PATH",
                    help="draft folder; repeat to compare drafts on the same prompts (omit for AR only)")
    ap.add_argument("--datasets", default="gsm8k,math500,humaneval,mbpp,mt-bench",
                    help=f"comma-separated eval tasks, each given once, of {', '.join(TASKS)} (infer.datasets; "
                         "default: all of them)")
    ap.add_argument("--data-dir", default=None, help="local eval folder (default: $DSPINE_SHARED/data/eval, else the Hub)")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--mix", action="store_true",
                    help=f"one task {MIXED!r}: the --datasets tasks' prompts (--num-prompts each) taken in turn, so "
                         "every batch mixes them, as a server's traffic does (MT-Bench's second turns then run as a "
                         "batch of their own)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt-tokens", type=int, default=1536,
                    help="a longer prompt keeps its last N tokens (the question and the assistant header), cut from "
                         "the front; also the longest admission the prefill graphs are made for (default 1536)")
    add_decode_args(ap, labels=True)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--config", action="append", default=None, metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                    help="the draft LABEL's own verify (chain|tree), tree_budget (2..64), budget (auto|none) or "
                         "chain_first (auto|yes|no: Engine's tree_chain_first; auto = best first at T = 0) or plan_trees "
                         "(the planner's tree sizes joined by '/', e.g. 16/32, or none; budget=auto only) or plan_chains "
                         "(the planner's chains narrower than the block, widths joined by '/', e.g. 4/8; budget=auto "
                         "only) or width (a fixed chain of that width, anchor included, below the block) or confidence "
                         "(greedy|always|never: when the planner gets the draft's confidence, Engine.plan_confidence; "
                         "budget=auto only) or conf_slope (auto or a number in 0..2: how far that confidence moves the "
                         "planner's estimate, Engine.plan_conf_slope; budget=auto only) or drain (off or "
                         f"{'|'.join(DRAIN_MODELS)}: the planner's drain rule off, or on with Engine.plan_drain_model, "
                         "persist by default; budget=auto only) or state (steps|kv|rows_kv: Engine.plan_state, "
                         "infer.planner 'State'; budget=auto only) or draft_vocab (a draft vocabulary file, or none "
                         "for the whole vocabulary; over --draft-vocab) over "
                         "the run-wide flags (which are checked as given), e.g. --draft chain=D --draft auto=D "
                         "--config auto:budget=auto: several verify modes of one draft timed in one run, alternated "
                         "per task (engine only; --block-size applies to the chain labels)")
    ap.add_argument("--device", default=None,
                    help="device of the engine, --backend cuda only (default cuda; cpu: eager, torch kernels; for tests)")
    ap.add_argument("--no-ar", action="store_true", help="skip the autoregressive baseline (needs --draft)")
    ap.add_argument("--warmup", default="auto", choices=["auto", "task", "start"],
                    help="task: decode each task once with every configuration, untimed, before the timed pass "
                         "(one-time costs at new prompt shapes are not counted; twice the run time); start: only the "
                         "start-up warm-up (short prompts, 32 tokens); auto (default): task on a CUDA engine, else start")
    ap.add_argument("--output-json", default=None, help="result JSON (refused if it exists, unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output-json / --plot file")
    ap.add_argument("--plot", default=None,
                    help="PNG of the drafts' accept_at_pos (needs --draft; default with --output-json: beside it)")
    ap.add_argument("--label", default=None, help="name of this configuration in the JSON/plot")
    return ap


def refuse_engine_options(args) -> None:
    """On the reference backend: ValueError naming the first of --budget auto, --exact and --prefill-buckets given."""
    for flag, given in (("--budget auto", args.budget), ("--exact", args.exact), ("--prefill-buckets", args.prefill_buckets)):
        if given:
            raise ValueError(f"{flag} needs the engine (--backend cuda; --device cpu on a CPU)")


def check_args(args) -> tuple[list[str], SamplingParams]:
    """Argument and path checks that need no model (so a typo fails in a second, not after loading).

    Returns the task names and the sampling settings. Raises ValueError / FileNotFoundError naming
    the argument."""
    from dspine.paths import check_output_file, looks_local
    from infer.datasets import task_name
    from infer.generate import check_decode_args, refuse_draft_options

    names = [t.strip() for t in args.datasets.split(",")]
    if not any(names) or not all(names):
        raise ValueError(f"--datasets {args.datasets!r}: give comma-separated task names (no empty entries)")
    tasks = [task_name(t) for t in names]
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        raise ValueError(f"--datasets {args.datasets!r}: {', '.join(twice)} given twice (it would run and count twice "
                         "in the means)")
    params = sampling_params(args)
    for name in ("num_prompts", "concurrency", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    tree_budget_given = args.tree_budget is not None  # check_decode_args fills in the default under --verify tree
    check_decode_args(args, plan_trees="--plan-trees 16/32 or --config LABEL:plan_trees=16/32")
    if args.device is not None and args.backend != "cuda":
        raise ValueError(f"--device {args.device} places the engine: give --backend cuda with it")
    args.device = args.device or "cuda"
    try:
        device_type = torch.device(args.device).type
    except RuntimeError:
        raise ValueError(f"--device {args.device!r}: not a torch device (cuda, cuda:N or cpu)") from None
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"--device {args.device!r}: the engine runs on cuda or cpu")
    if device_type == "cpu":
        args.device = "cpu"  # cpu:N names the same device, which safetensors does not take
    if args.backend == "reference":
        refuse_engine_options(args)
    if args.plan_drain is not None and args.backend == "reference":
        raise ValueError("--plan-drain / --no-plan-drain need the engine's --budget auto (--backend cuda; --device cpu "
                         "on a CPU)")
    if not args.draft:
        refuse_draft_options(args, (("--no-ar", args.no_ar), ("--plot", args.plot is not None)))
    for label, path in parse_drafts(args.draft).items():
        if not path.strip() or not label:
            raise ValueError(f"--draft {label}={path}: give [LABEL=]PATH with a path and a label")
        if not Path(path).is_dir() and (looks_local(path) or Path(path).exists()):
            raise FileNotFoundError(f"--draft {label}={path}: no such draft folder")
    if args.config and args.backend == "reference":
        raise ValueError("--config needs the engine (--backend cuda; --device cpu on a CPU)")
    args.configs = parse_configs(args.config, parse_drafts(args.draft), args, tree_budget_given)
    if any(c["budget"] for c in args.configs.values()):  # a DSPINE_PLAN_LOG that cannot be written fails now
        plan_log_path()
    # a draft vocabulary file that is not there fails now, not after the models; the run-wide one is checked as
    # given, also where every label overrides it
    for flag, v in vocab_flags(args.draft_vocab, args.configs).items():
        if not Path(v).is_file():
            if Path(v).is_dir():
                raise ValueError(f"{flag} {v}: a folder; give the draft vocabulary's .safetensors file")
            raise FileNotFoundError(f"{flag} {v}: no such file")
    if args.plot is None and args.output_json and args.draft:  # derived once; main() writes it there
        args.plot = str(Path(args.output_json).with_suffix(".png"))
        if Path(args.plot).resolve() == Path(args.output_json).resolve():  # an --output-json named X.png
            raise ValueError(f"--output-json {args.output_json}: the plot would be written over it (it goes beside "
                             "the JSON with a .png suffix); name the results file X.json, or give --plot")
    if args.plot is not None and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"--plot {args.plot}: give a file ending in {', '.join(PLOT_SUFFIXES)} (matplotlib writes "
                         "the format its suffix names)")
    outputs = {"--output-json": args.output_json, "--plot": args.plot}
    if args.plot and args.output_json and Path(args.plot).resolve() == Path(args.output_json).resolve():
        raise ValueError(f"--plot {args.plot} and --output-json {args.output_json} name the same file")
    if any(c["budget"] for c in args.configs.values()) and os.environ.get("DSPINE_PLAN_LOG"):
        for flag, path in outputs.items():  # the step log is appended to during the run, the results written after
            if path and Path(path).resolve() == Path(os.environ["DSPINE_PLAN_LOG"]).resolve():
                raise ValueError(f"DSPINE_PLAN_LOG={os.environ['DSPINE_PLAN_LOG']} and {flag} {path} name the same "
                                 "file; give the step log its own")
    for flag, path in outputs.items():  # before any work: a benchmark must not end in an unwritable path
        if path is not None:
            check_output_file(flag, path, args.overwrite)
    # an interrupted run that would replace a finished file writes its finished tasks beside it instead
    args.replaces_output = bool(args.output_json) and Path(args.output_json).exists()
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir {args.data_dir}: no such folder")
    if args.backend == "cuda" and device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--backend cuda needs a CUDA GPU; use --backend reference on the CPU")
    return tasks, params


def vocab_flags(draft_vocab: str | None, configs: dict) -> dict[str, str]:
    """The flags that name a draft vocabulary file -> that file: ``--draft-vocab`` (``draft_vocab``, when given,
    used by a label or not) and ``--config LABEL[,LABEL...]:draft_vocab`` for the files only labels name
    (``configs``: :func:`parse_configs`' result)."""
    out = {} if draft_vocab is None else {"--draft-vocab": draft_vocab}
    labels: dict[str, list[str]] = {}
    for label, c in configs.items():
        v = c["draft_vocab"]
        if v is not None and v != draft_vocab:
            labels.setdefault(v, []).append(label)
    out.update({f"--config {','.join(ls)}:draft_vocab": v for v, ls in labels.items()})
    return out


PLOT_SUFFIXES = (".png", ".pdf", ".svg")  # --plot: formats matplotlib writes by the suffix


def main(argv=None) -> int:
    """Run the benchmark (module docstring); returns the exit status: 0, 1 (exact mode's outputs differ), 2 (bad
    input), 130 (Ctrl-C) or 143 (SIGTERM): both keep the finished tasks; a SIGTERM once every task has finished
    lets the results be written whole, then exits 143."""
    from dspine.io import sigterm_as_ctrl_c

    with sigterm_as_ctrl_c() as stop:
        return _main(argv, stop)


def _main(argv, stop) -> int:
    from dspine.io import write_json_new
    from dspine.provenance import provenance, utc_now
    from dspine.reference import set_cpu_threads

    args = build_parser().parse_args(argv)
    # the commit, date and command when the run starts: a run of minutes to hours measures the code it loaded then,
    # whatever is committed while it runs (the JSON adds "finished", the date it was written)
    prov = provenance()
    rows: list[dict] = []

    def keep_finished(error: str | None = None) -> str:
        """Write the finished tasks (complete results) with ``"interrupted": true`` (and the ``error`` that stopped
        the run); returns what happened to --output-json, for the closing line."""
        if not args.output_json:
            return ""
        if not rows:
            return f"; nothing was written to {args.output_json}"
        out = Path(args.output_json)
        if getattr(args, "replaces_output", False):  # --overwrite of a finished file: it stays as it was
            out = out.with_name(out.stem + ".interrupted" + out.suffix)
        out.parent.mkdir(parents=True, exist_ok=True)
        # never over a file: an earlier run's X.interrupted.json, or a file another run wrote since the start
        out = write_json_new(out, {**prov, "finished": utc_now(), "label": args.label, "backend": runner.backend,
                                   "args": vars(args), "interrupted": True, **({"error": error} if error else {}),
                                   "tasks": rows, "summary": summarize(rows)}, indent=1, allow_nan=True)
        kept = f"; {args.output_json} is left as it was" if out != Path(args.output_json) else ""
        return f"; wrote them to {out} (\"interrupted\": true){kept}"

    try:
        tasks, params = check_args(args)
        args.mix_tasks = tasks if args.mix else None
        tasks = [MIXED] if args.mix else tasks
        items = load_tasks(args, tasks)  # every task's prompts before the models: a missing eval file fails now
        # Engine.generate runs min(concurrency, prompts) rows: caches and the warm-up at that batch, not a larger one
        args.max_batch = min(args.concurrency, max(map(len, items.values())))
        if args.max_batch < args.concurrency:
            print(f"note: --concurrency {args.concurrency}, but no task has more than {args.max_batch} prompts: "
                  f"batches of at most {args.max_batch}", file=sys.stderr)
        args.threads = set_cpu_threads(args.threads)
        runner = Runner(args)
        # warm-up every timed path (graph capture, kernel compilation) at the timed batch size
        from infer.datasets import load_eval_prompts

        first = args.mix_tasks[0] if args.mix else tasks[0]
        warm = [encode(runner, p.turns[0]) for p in load_eval_prompts(first, args.max_batch, args.data_dir)]
        wp = dataclasses.replace(params, max_new_tokens=min(32, args.max_new_tokens))
        for label in [None, *runner.drafts]:
            runner.run(warm, wp, label, {"pass": "start"})
        runner.planner_steps.clear()  # the planner's choices of the timed runs only
        if runner.backend != "cuda":
            args.device = None  # the reference backend runs where the target loads (the CPU)
        if args.warmup == "auto":
            on_gpu = runner.backend == "cuda" and torch.device(args.device).type == "cuda"
            args.warmup = "task" if on_gpu else "start"
        for i, t in enumerate(tqdm(tasks, desc="tasks", unit="task")):
            rows.append(run_task(runner, t, params, do_ar=not args.no_ar, order_shift=i, warmup=args.warmup == "task",
                                 items=items[t]))
        stop.hold = True  # every task finished: a SIGTERM now waits for the results to be written
    except (ValueError, OSError, RuntimeError, FloatingPointError) as e:  # OSError: an unreachable Hub id, files
        print(f"error: {e}", file=sys.stderr)
        if rows:  # a later task failed (non-finite logits, ...): the tasks before it are complete results
            print(f"tasks finished: {', '.join(r['task'] for r in rows)}{keep_finished(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        done = ", ".join(r["task"] for r in rows) or "none"
        print(f"\n{'terminated' if stop.terminated else 'interrupted'}: tasks finished: {done}{keep_finished()}",
              file=sys.stderr)
        return 143 if stop.terminated else 130
    summary = summarize(rows)
    print(table(rows))
    for label, e in summary.items():
        extra = ("" if "mean_speedup" not in e else ", speedup n/a (no verify step)" if e["mean_speedup"] is None
                 else f", mean speedup {e['mean_speedup']:.2f}x")
        same = "greedy" if args.temperature == 0 else "invariant"
        eq = f", {same} == AR on {e['greedy_equal']}/{e['greedy_compared']}" if "greedy_compared" in e else ""
        ci = f" [95% CI {e['mean_tau_ci95'][0]:.3f}, {e['mean_tau_ci95'][1]:.3f}]" if "mean_tau_ci95" in e else ""
        c = runner.configs[label]
        if c["budget"]:
            names = {"ar": "AR", "chain": "the chain of {}", "tree": "the tree of {}"}
            modes = runner.decoders[label].planner_modes(params)
            how = "--budget auto: the planner picks per step among " + ", ".join(names[k].format(n) for k, n in modes)
        else:
            how = f"--verify {c['verify']}: {runner.verified_per_step[label]} verified tokens per step"
        tau = "n/a (no verify step)" if e["mean_tau"] is None else f"{e['mean_tau']:.3f}"
        none = f" ({e['tasks_without_steps']} task(s) without a verify step left out)" if "tasks_without_steps" in e else ""
        print(f"{label}: mean tau {tau}{ci}{none}{extra}{eq}, {how}")
        for r in rows:  # fast mode: where outputs part, and how close the target's top-2 were there
            for m in r["drafts"].get(label, {}).get("greedy_mismatches", []):
                margin = m.get("ar_top2_margin")
                print(f"  {r['task']}: differs from AR at output position {m['position']}"
                      + (f", target top-2 margin {margin:.4f} (tokens {m['ar_top2']})" if margin is not None else ""))
    dt = "" if args.draft_temperature is None else f", draft temperature {args.draft_temperature}"
    dt += ", invariant verification" if getattr(args, "invariant", False) and args.temperature > 0 else ""
    on_gpu = runner.backend == "cuda" and torch.device(args.device).type == "cuda"
    where = (f"engine on {torch.cuda.get_device_name(torch.device(args.device))}" if on_gpu else
             "engine on the CPU (--device cpu)" if runner.backend == "cuda" else "reference backend on the CPU")
    print(f"[{where}, T={args.temperature}, top_p={args.top_p}, top_k={args.top_k}{dt}, concurrency "
          f"{args.concurrency}, max_new_tokens {args.max_new_tokens}; tau counts the bonus token]")
    result = {**prov, "finished": utc_now(), "label": args.label, "backend": runner.backend, "args": vars(args),
              "interrupted": False, "tasks": rows, "summary": summary}
    if args.output_json:
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        # over a file there at the start only with --overwrite; one written since goes beside it, with a note
        written = write_json_new(out, result, indent=1, allow_nan=True, replace=args.replaces_output,
                                 what="this run's results are")
        if args.plot and written != out:  # the plot takes the results' name (b.2.png): b.png may be that run's
            args.plot = str(Path(args.plot).with_stem(Path(args.plot).stem + written.stem[len(out.stem):]))
            write_json_new(written, result, indent=1, allow_nan=True, replace=True)  # args.plot: the path written
    if args.plot and summary:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, Path(args.plot), args.label or f"T={args.temperature}, concurrency {args.concurrency}")
    if args.exact:
        bad = sum(len(d.get("greedy_mismatches", [])) for r in rows for d in r["drafts"].values())
        if bad:
            print(f"error: exact mode: {bad} greedy speculative outputs differ from the AR output (a bug, not "
                  "rounding)", file=sys.stderr)
            return 1
    return 143 if stop.terminated else 0


if __name__ == "__main__":
    sys.exit(main())
