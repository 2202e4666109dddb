"""Replace the assistant turns of normalized rows with the target's own answers.

    python -m data.regenerate --target PATH_OR_HUB_ID [--gguf-file FILE] [--tokenizer PATH] --input FILE
        --output DIR [--chat-template FILE|chatml] [--max-new-tokens 1024] [--temperature 0] [--top-p 1]
        [--top-k 0] [--enable-thinking] [--max-turns 0] [--max-context N] [--limit N] [--batch-size 16]
        [--backend auto|hf|engine] [--seed 0] [--profile]
    accelerate launch -m data.regenerate ...      # data parallel, one process per GPU

Each row keeps its system and user turns; the original answers are dropped and the target answers
turn by turn: user turn k is followed by the target's answer given the conversation so far (which
holds its own earlier answers), rendered with the chat template exactly as at inference.

DIR receives `results.jsonl` (regenerated rows, plus `finish_reason` per generated turn,
`generated_token_ids` per turn and `num_generated_tokens`), `errors.jsonl` (rows whose generation
failed, with the error), `skipped.jsonl` (unusable rows, with the reason), all in input order, and
`summary.json`. results + errors + skipped = input rows, checked in the summary.

Resume: records are appended per batch to per-rank shards (`results.rank{r}.jsonl`, ...) and
flushed; a re-run with the same arguments skips every row already recorded, so nothing is computed
twice or lost, and rank 0 merges the shards in input order at the end. `run_args.json` stores the
arguments that change the output; a run with different ones in the same DIR is refused (a run that
regenerated no row unpins them: it leaves no summary.json or run_args.json, only skipped.jsonl and
errors.jsonl to read, so a corrected rerun may change them). Rank r of
W processes takes the input rows i with i % W == r, in fixed batches of consecutive rows, so a
resumed run forms the same batches (same greedy outputs) as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from data.chat import encode, render, resolve_chat_template, stop_token_ids, template_digest
from data.generate import BACKENDS, Generation, format_profile, load_generator, resolve_backend
from data.rows import CHAT_TEMPLATE_HELP, EXIT_STATUS, JsonlAppender, atomic_write_json, batched, iter_jsonl
from data.schema import RowError, check_row
from data.shards import (
    clear_markers,
    done_indices,
    merge_shards,
    remove_shards,
    shard_path,
    wait_for_ranks,
    write_marker,
)
from dspine.io import folder_lock, sigterm_as_ctrl_c
from dspine.paths import load_tokenizer, read_json_object, resolve_model_path

KINDS = ("results", "errors", "skipped")
RUN_ARGS = "run_args.json"
SUMMARY = "summary.json"
# Arguments that change the output: a resumed run must repeat them exactly.
CONTENT_ARGS = (
    "input", "input_digest", "target", "gguf_file", "tokenizer", "chat_template", "chat_template_digest",
    "max_new_tokens", "temperature", "top_p", "top_k", "enable_thinking", "max_turns", "max_context",
    "limit", "seed", "dtype",
)  # fmt: skip
# Distillation trains on <= 3072-token sequences (docs/method.md §4): longer prompts are of no use, and
# this bounds the KV cache the engine backend preallocates (batch x max context).
DEFAULT_MAX_CONTEXT = 8192
PATH_ARGS = ("input", "target", "tokenizer", "chat_template")
# Test hook: raise after this many batches were written (simulates a killed run).
STOP_AFTER_ENV = "DSPINE_REGEN_STOP_AFTER_BATCHES"
GENERATED_FIELDS = (
    "index",
    "id",
    "conversations",
    "finish_reason",
    "num_generated_tokens",
    "generated_token_ids",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data.regenerate", description=__doc__.split("\n")[0],
                                epilog=EXIT_STATUS)
    p.add_argument("--target", required=True, help="target model: local HF folder, Hub id, or folder of --gguf-file")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --target")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder/id if not the target's")
    p.add_argument("--input", required=True, help="normalized JSONL (data.prepare output)")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--enable-thinking", action="store_true", help="Qwen3 thinking mode (default: off)")
    p.add_argument("--max-turns", type=int, default=0, help="answer at most N user turns per row (0 = all)")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help=f"prompt + max_new_tokens limit in tokens, at most the model's max_position_embeddings; longer prompts "
        f"are skipped (default: that, at most {DEFAULT_MAX_CONTEXT}; the engine preallocates KV for batch x this)",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N input rows")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="target weights: auto = bf16 on CUDA, fp32 on the CPU (bf16 is faster on CPUs with AVX512-BF16/AMX)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="rows per generate call and per resumable write (the unit a killed run loses)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="engine backend: sequences decoded at once (KV cache slots; default --batch-size). A "
                   "batch larger than this keeps every slot busy: finished rows are refilled from the batch")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--profile", action="store_true",
                   help="engine backend: print where the decode loop's time went (ms per step: launch, waiting "
                   "for the device, host bookkeeping, admission) at the end, on stderr")
    args = p.parse_args(argv)
    from dspine.sampling import sampling_params

    for name in ("max_new_tokens", "batch_size", "concurrency", "max_context", "limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.max_turns < 0:
        p.error(f"--max-turns {args.max_turns}: must be >= 0 (0 = all)")
    try:  # the same rules as infer.generate / infer.bench: finite temperature >= 0, 0 < top-p <= 1, top-k >= 0
        sampling_params(args)
    except ValueError as e:
        p.error(str(e))
    return args


# ------------------------------------------------------------------------------------- run setup


def scan_input(path: str | Path, limit: int | None) -> tuple[str, int]:
    """Returns (content digest of the whole file, number of rows = non-blank lines, capped by `limit`)."""
    h, rows = hashlib.blake2b(digest_size=16), 0
    with open(path, "rb") as f:
        for line in f:
            h.update(line)
            rows += bool(line.strip())
    return h.hexdigest(), rows if limit is None else min(rows, limit)


def check_run_args(out: Path, run_args: dict, write: bool) -> None:
    """Compares `run_args` with DIR/run_args.json (writing it first if absent and `write`).

    Raises:
        ValueError: naming each differing argument with its stored and new value.
    """
    path = out / RUN_ARGS
    if not path.exists():
        if write:
            atomic_write_json(path, run_args)
        return
    stored = read_json_object(path, "data.regenerate run arguments")
    diff = [
        f"{k}: {stored.get(k)!r} (stored) != {run_args.get(k)!r} (this run)"
        for k in CONTENT_ARGS
        if stored.get(k) != run_args.get(k)
    ]
    if diff:
        raise ValueError(
            f"{out} holds a run with different generation arguments ({RUN_ARGS}): "
            + "; ".join(diff)
            + ". Repeat them to resume, or use another --output."
        )


def model_context(target: str, gguf_file: str | None) -> int | None:
    """The target's max_position_embeddings, or None if its config does not say."""
    from transformers import AutoConfig

    from dspine.config import text_config

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return getattr(text_config(AutoConfig.from_pretrained(target, **kwargs)), "max_position_embeddings", None)


# ----------------------------------------------------------------------------------- generation


@dataclass
class _Chat:
    """One row being regenerated: its prompt turns (system/user) and the conversation so far."""

    index: int
    row_id: str
    row: dict
    prompt_turns: list[dict]
    history: list[dict] = field(default_factory=list)
    next_turn: int = 0
    finish: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    stopped: str | None = None

    def advance(self) -> bool:
        """Appends prompt turns up to the next user turn; False when no user turn is left."""
        while self.next_turn < len(self.prompt_turns):
            turn = self.prompt_turns[self.next_turn]
            self.history.append(turn)
            self.next_turn += 1
            if turn["role"] == "user":
                return True
        return False

    def result(self) -> dict:
        extra = {k: v for k, v in self.row.items() if k not in GENERATED_FIELDS}
        record = {"index": self.index, "id": self.row_id, **extra, "conversations": self.history}
        record.update(
            finish_reason=self.finish,
            num_generated_tokens=sum(len(t) for t in self.token_ids),
            generated_token_ids=self.token_ids,
        )
        if self.stopped:
            record["stopped"] = self.stopped
        return record


def _prompt_turns(turns: list[dict], max_turns: int) -> list[dict]:
    """System and user turns in order, cut after the `max_turns`-th user turn (0 = all).

    Raises:
        RowError: "no_user_turn".
    """
    kept, users = [], 0
    for turn in turns:
        if turn["role"] == "assistant":
            continue
        if turn["role"] == "user":
            if max_turns and users == max_turns:
                break
            users += 1
        kept.append(turn)
    if not users:
        raise RowError("no_user_turn", "the conversation has no user turn to answer")
    return kept


def regenerate_batch(rows, tokenizer, template: str, generator, args, max_context, seed_key: int = 0) -> dict:
    """Regenerates one batch of input rows.

    Args:
        rows: (input index, parsed row or RowError) pairs.
        max_context: prompt tokens + max_new_tokens may not exceed this (None = no limit).
        seed_key: batch identity mixed into the sampling seed (the first input index of the batch).
    Returns:
        {"results": [...], "errors": [...], "skipped": [...]} records; every row lands in exactly one.
    """
    out = {kind: [] for kind in KINDS}
    chats = []
    for index, row in rows:
        try:
            if isinstance(row, RowError):
                raise row
            row_id, turns = check_row(row)
            chats.append(_Chat(index, row_id, row, _prompt_turns(turns, args.max_turns)))
        except RowError as e:
            row_id = row.get("id") if isinstance(row, dict) else None
            raw = e.raw if e.raw is not None else row
            out["skipped"].append({"index": index, "id": row_id, "reason": e.code, "detail": str(e), "row": raw})

    def prompt_text(turns: list[dict]) -> str:  # also handed to encode, which renders the turns again with markers
        return render(tokenizer, template, turns, True, args.enable_thinking)

    turn = 0
    active = [c for c in chats if c.advance()]
    while active:
        prompts, ready = [], []
        for chat in active:
            try:
                text = prompt_text(chat.history)
                ids = encode(tokenizer, text, chat.history, prompt_text)  # system/user text stays plain text
            except Exception as e:  # a template can raise on any row (jinja errors, bad roles)
                out["errors"].append(_error(chat, f"chat template failed at turn {turn}: {type(e).__name__}: {e}"))
                continue
            if max_context is not None and len(ids) + args.max_new_tokens > max_context:
                detail = (f"prompt of turn {turn} is {len(ids)} tokens; with max_new_tokens {args.max_new_tokens} "
                          f"it exceeds the context of {max_context}")
                if turn == 0:
                    out["skipped"].append(
                        {
                            "index": chat.index,
                            "id": chat.row_id,
                            "reason": "prompt_too_long",
                            "detail": detail,
                        }
                    )
                else:  # keep the turns answered so far; the rest of the conversation is dropped
                    chat.history.pop()
                    chat.stopped = f"context: {detail}"
                    out["results"].append(chat.result())
                continue
            prompts.append(ids)
            ready.append(chat)

        digest = hashlib.blake2b(f"{args.seed}:{seed_key}:{turn}".encode(), digest_size=4).digest()
        generations = _generate_robust(generator, prompts, args, seed=int.from_bytes(digest, "big") & 0x7FFFFFFF)
        active = []
        for chat, gen in zip(ready, generations):
            if isinstance(gen, Exception):
                out["errors"].append(_error(chat, f"generation failed at turn {turn}: {type(gen).__name__}: {gen}"))
                continue
            text = tokenizer.decode(gen.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            chat.history.append({"role": "assistant", "content": text})
            chat.finish.append(gen.finish_reason)
            chat.token_ids.append(gen.token_ids)
            if chat.advance():
                active.append(chat)
            else:
                out["results"].append(chat.result())
        turn += 1
    return out


def _error(chat: _Chat, message: str) -> dict:
    return {"index": chat.index, "id": chat.row_id, "error": message, "row": chat.row}


def _generate_robust(generator, prompts, args, seed) -> list[Generation | Exception]:
    """Generates a batch; if the batch fails, retries each prompt alone so one bad row cannot sink the others."""
    if not prompts:
        return []
    params = (args.max_new_tokens, args.temperature, args.top_p, args.top_k, seed)
    try:
        return generator.generate(prompts, *params)
    except Exception as batch_error:
        if len(prompts) == 1:
            return [batch_error]
    results = []
    for prompt in prompts:
        try:
            results.append(generator.generate([prompt], *params)[0])
        except Exception as e:
            results.append(e)
    if all(isinstance(r, Exception) for r in results):
        # Every row failed on its own too: a broken device or model, not bad rows. Stop rather
        # than file the whole input under errors; the run resumes once the cause is fixed.
        raise RuntimeError(f"generation failed for all {len(prompts)} rows of a batch") from results[0]
    return results


# ---------------------------------------------------------------------------------------- finish


def _count(kind: str, record: dict, stats: Counter) -> None:
    if kind == "results":
        stats["generated_turns"] += len(record["finish_reason"])
        stats["length_turns"] += record["finish_reason"].count("length")
        stats["generated_tokens"] += record["num_generated_tokens"]
        stats["stopped_by_context"] += "stopped" in record
    elif kind == "skipped":
        stats["skipped:" + record["reason"]] += 1


def finish(out: Path, n_rows: int, run_args: dict, backend: str, world: int, started: float | None = None,
           resumed: bool = False) -> dict:
    """Rank 0: merge shards, write summary.json, then remove the shards (no summary.json and no
    run_args.json when no row was regenerated).

    ``started`` (time.time() at the start of this invocation) adds ``wall_s`` and, for a run that
    generated everything itself (not ``resumed``), ``generated_tokens_per_s``."""
    stats = Counter()
    counts = merge_shards(out, KINDS, n_rows, lambda kind, record: _count(kind, record, stats))
    stats.update(counts)
    turns = stats["generated_turns"]
    reasons = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("skipped:")}
    summary = {
        "input": run_args["input"],
        "input_rows": n_rows,
        "results": stats["results"],
        "errors": stats["errors"],
        "skipped": stats["skipped"],
        "adds_up": stats["results"] + stats["errors"] + stats["skipped"] == n_rows,
        "generated_turns": turns,
        "length_turns": stats["length_turns"],
        "truncation_rate": stats["length_turns"] / turns if turns else 0.0,
        "generated_tokens": stats["generated_tokens"],
        "stopped_by_context": stats["stopped_by_context"],
        "skipped_reasons": reasons,
        "backend": backend,
        "world_size": world,
    }
    if started is not None:
        summary["wall_s"] = round(time.time() - started, 2)
        summary["resumed"] = resumed
        if not resumed and summary["wall_s"] > 0:
            summary["generated_tokens_per_s"] = round(summary["generated_tokens"] / summary["wall_s"], 1)
    if summary["results"]:
        atomic_write_json(out / SUMMARY, summary)
    remove_shards(out)
    if not summary["results"]:
        # Nothing to train on: do not mark DIR finished nor pin its arguments, so a corrected rerun
        # (other arguments or input) is not refused; skipped.jsonl / errors.jsonl stay for reading. After the
        # shards: an interruption never leaves them without the arguments that made them
        (out / "results.jsonl").unlink(missing_ok=True)
        (out / RUN_ARGS).unlink(missing_ok=True)
    return summary


# ------------------------------------------------------------------------------------------ main


def regenerate(args: argparse.Namespace) -> dict:
    """Runs (or resumes) a regeneration into args.output and returns the summary.

    Raises:
        ValueError: arguments differ from the run already in args.output, no chat template, bad input.
        NotImplementedError: --backend engine while infer.engine does not exist.
    """
    import torch
    from accelerate import PartialState

    started = time.time()
    # cpu=True lets a CPU-only launch (torchrun / accelerate launch --cpu) form a gloo group.
    state = PartialState(cpu=not torch.cuda.is_available())
    rank, world = state.process_index, state.num_processes
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world:  # every process would think it is rank 0 and write the same shards
        raise RuntimeError(f"launched with WORLD_SIZE={launched} but accelerate sees {world} process(es)")
    out = Path(args.output)
    if not Path(args.input).is_file():
        raise FileNotFoundError(f"--input {args.input}: no such file")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out} is an existing file; give a folder")
    if (out / SUMMARY).exists() and not (out / "run_args.json").exists():
        raise ValueError(f"{out} holds a {SUMMARY} that no data.regenerate run wrote (another tool's output?); "
                         "choose another --output")
    # a .gguf path becomes (folder, file name) here, so run_args.json and every loader see one spelling
    args.target, args.gguf_file = resolve_model_path(args.target, args.gguf_file, need_config=True)
    from dspine.target import TargetSpec

    spec = TargetSpec.from_pretrained(args.target, args.gguf_file, with_tokenizer=False)
    backend = resolve_backend(args.backend)
    if backend == "engine" and spec.engine_layer_problems and args.backend == "auto":
        print(f"note: {'; '.join(spec.engine_layer_problems)}: not in the engine; --backend auto uses hf", file=sys.stderr)
        backend = "hf"
    spec.check_supported(engine=backend == "engine")
    if args.concurrency is not None and backend != "engine":
        raise ValueError(f"--concurrency {args.concurrency} sets the engine's KV cache slots; the {backend} backend "
                         "decodes --batch-size rows at a time (drop --concurrency or use --backend engine)")
    args.concurrency = args.concurrency or args.batch_size
    tokenizer = load_tokenizer(args.tokenizer or args.target, None if args.tokenizer else args.gguf_file)
    if len(tokenizer) > spec.vocab_size:  # its ids past the target's embedding would fail every batch
        raise ValueError(f"tokenizer {args.tokenizer or args.target} has {len(tokenizer)} tokens > the {spec.vocab_size}"
                         f" embedding rows of target {spec.name} (another model's tokenizer?)")
    template = resolve_chat_template(args.chat_template, tokenizer)
    # the answers are only useful if data.tokenize can mask them: check the template before generating
    from data.tokenize import check_template

    check_template(tokenizer, template, args.enable_thinking)
    max_context = args.max_context or min(
        model_context(args.target, args.gguf_file) or DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT
    )
    if args.max_context and args.max_context > (spec.max_position_embeddings or args.max_context):
        raise ValueError(f"--max-context {args.max_context} exceeds the {spec.max_position_embeddings} positions of "
                         f"target {spec.name} (max_position_embeddings): answers would run past what it was trained on")
    if args.max_new_tokens >= max_context:  # every prompt would be skipped: refuse before writing anything
        source = "--max-context" if args.max_context else \
            f"the model's max_position_embeddings, at most {DEFAULT_MAX_CONTEXT}; --max-context sets it"
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt: it must be "
                         f"below the context of {max_context} tokens ({source})")
    input_digest, n_rows = scan_input(args.input, args.limit)
    if not n_rows:
        raise ValueError(f"{args.input} has no rows (only blank lines, or empty): nothing to regenerate")
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out, state.is_main_process):  # a second run on this folder is refused, not mixed in
        # local paths compare by absolute location, so a resume may spell them differently
        run_args = {k: str(Path(v).resolve()) if k in PATH_ARGS and v and Path(v).exists() else v
                    for k, v in vars(args).items() if k in CONTENT_ARGS}
        run_args.update(
            input_digest=input_digest, chat_template_digest=template_digest(template), max_context=max_context
        )
        check_run_args(out, run_args, write=state.is_main_process)
        if state.is_main_process:  # an earlier run's markers must not count for this one; only the lock holder
            clear_markers(out)  # clears them: another launch's rank 1 would remove a running launch's marker
        state.wait_for_everyone()
        check_run_args(out, run_args, write=False)
        if (out / SUMMARY).exists():
            if state.is_main_process:
                remove_shards(out)  # those of a run killed after its summary.json
                print(f"{out} is already finished; nothing to do")
            return json.loads((out / SUMMARY).read_text())

        from transformers import GenerationConfig

        try:
            gen_cfg = GenerationConfig.from_pretrained(args.target)
        except OSError:  # no generation_config.json (e.g. a GGUF folder)
            gen_cfg = None
        stop_ids = stop_token_ids(tokenizer, template, gen_cfg)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        generator = load_generator(
            backend, args.target, args.gguf_file, stop_ids, pad_id, state.device,
            args.concurrency if backend == "engine" else args.batch_size, max_context,
            dtype=args.dtype,
        )

        resumed = bool(done_indices(out))
        _run_rank(out, rank, world, n_rows, tokenizer, template, generator, args, max_context)
        if args.profile and getattr(generator, "profile", None):
            print(f"rank {rank} {format_profile(generator.profile)}", file=sys.stderr, flush=True)
        write_marker(out, rank, world)
        if not state.is_main_process:
            return {}
        wait_for_ranks(out, world)
        return finish(out, n_rows, run_args, backend, world, started, resumed)


def _run_rank(out, rank, world, n_rows, tokenizer, template, generator, args, max_context) -> None:
    from tqdm import tqdm

    done = done_indices(out)
    stop_after = int(os.environ.get(STOP_AFTER_ENV, "0"))
    writers = {kind: JsonlAppender(shard_path(out, kind, rank)) for kind in KINDS}
    mine = len(range(rank, n_rows, world))
    progress = tqdm(total=mine, initial=0, desc=f"rank {rank}", unit=" rows", disable=rank != 0, file=sys.stderr)
    batches = 0

    def run(chunk):
        nonlocal batches
        pending = [(i, row) for i, row in chunk if i not in done]
        progress.update(len(chunk))
        if not pending:
            return
        records = regenerate_batch(pending, tokenizer, template, generator, args, max_context, seed_key=chunk[0][0])
        for kind in KINDS:
            writers[kind].write(records[kind])
        batches += 1
        if stop_after and batches >= stop_after:
            raise RuntimeError(f"{STOP_AFTER_ENV}={stop_after}: stopping after {batches} batches (test hook)")

    try:  # this rank's rows: index < n_rows with index % world == rank, in batches of --batch-size
        for chunk in batched(islice(enumerate(iter_jsonl(args.input)), rank, n_rows, world), args.batch_size):
            run(chunk)
    finally:
        progress.close()
        for w in writers.values():
            w.close()


def format_summary(summary: dict) -> str:
    return (
        f"input rows {summary['input_rows']} = results {summary['results']} + errors {summary['errors']} "
        f"+ skipped {summary['skipped']}: {'ok' if summary['adds_up'] else 'MISMATCH'}\n"
        f"generated turns {summary['generated_turns']}, tokens {summary['generated_tokens']}, "
        f"truncation rate (finish_reason length) {summary['truncation_rate']:.2%}, "
        f"cut by context {summary['stopped_by_context']}\n"
        f"skipped reasons {summary['skipped_reasons']}; backend {summary['backend']}, world size {summary['world_size']}"
    )


@sigterm_as_ctrl_c()  # SIGTERM (a scheduler's stop) takes the Ctrl-C path below
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    marker = Path(args.output) / SUMMARY
    finished = os.path.isfile(marker)  # before this run: then a summary.json is no sign that this run got to its end
    try:
        summary = regenerate(args)
    except (ValueError, OSError, NotImplementedError) as e:  # OSError: missing files, an unreachable Hub id
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # every written batch is whole (JsonlAppender): the same command resumes after it
        if finished or not os.path.isfile(marker):
            print(f"\ndata.regenerate: interrupted; the batches written to {args.output} are kept and the same "
                  "command resumes after them", file=sys.stderr)
            return 130
        # after this run's summary.json (finish's commit): the output is whole, only the shards' removal was left
        remove_shards(marker.parent)
        summary = json.loads(marker.read_text())
    if summary:
        print(format_summary(summary))
        if not summary["results"]:
            print(f"error: no row was regenerated ({summary['skipped']} skipped, {summary['errors']} failed; see "
                  f"{Path(args.output) / 'skipped.jsonl'} and errors.jsonl); nothing to train on (the folder is "
                  "not marked finished: a corrected rerun may reuse it)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
