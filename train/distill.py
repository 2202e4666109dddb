"""Train a DSpine (or DFlash, ``injection: none``) draft against a frozen target (docs/method.md §4).

    accelerate launch [--config_file configs/accelerate/zero2.yaml] train/distill.py \\
        --config configs/qwen3-8b-dspine-b16.yaml [key=value ...]
    python train/distill.py --config configs/stories260k-cpu.yaml        # one process

Only the draft goes through ``accelerator.prepare`` (DDP or DeepSpeed ZeRO-2/3); the target stays
a plain frozen module on each rank's device and supplies features (online, or from a
``train.capture`` folder), the block embeddings and the lm_head. Outputs in ``output_dir``:
``config.yaml``, ``metrics.jsonl`` (one JSON object per logged step / eval), ``step-N/`` checkpoints
(``draft/`` = loadable draft folder, ``state/`` = optimizer, scheduler, RNG per rank,
``trainer_state.json`` = step, data position, the logging window since the last metrics row and whether the step's
eval is pending: a resume writes the rows of an uninterrupted run) and a ``latest`` pointer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python train/distill.py` / `accelerate launch train/distill.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:  # a Ctrl-C during these imports (seconds: torch, transformers) is one line, not a traceback through them
    import torch
    import yaml

    from dspine.io import folder_lock
    from dspine.paths import load_tokenizer, read_json_object
    from train import config as run_config
    from train.config import ConfigError
    from train.data import (
        CaptureRows,
        ConcatRows,
        StepBatches,
        StepOrder,
        expected_fields,
        last_layer_features,
        make_batch,
        open_rows,
        open_sources,
        split_sources,
        step_loader,
    )
    from train.loss import LossStats, anchor_generator, tau_sim
    from train.speed import compile_layers, eager_forwards, length_buckets, set_fused_adam
    from train.step import StepSettings, make_optimizer, make_scheduler, micro_loss, reduce_sum, train_step
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    print("\ninterrupted: while starting up, nothing was written", file=sys.stderr)
    sys.exit(130)


def main(argv: list[str] | None = None) -> int:
    # ---------------------------------------------------------------------------------------- config
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, _ = run_config.parse_cli(argv, "train/distill.py")
        code = relaunch_cpu_ranks(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the config is read: nothing was written yet
        print("\ninterrupted: nothing was written", file=sys.stderr, flush=True)
        return 130
    if code is not None:
        return code
    dump_stacks_on_sigusr1()
    out = Path(cfg.output_dir)
    fresh = not out.exists()
    code = 2
    try:
        if not out.exists():  # rank 0 holds the folder to the end: a second run on it is refused, not mixed in
            out.mkdir(parents=True, exist_ok=True)
        with folder_lock(out, hold=int(os.environ.get("RANK", "0")) == 0):
            return train(cfg)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
    except OSError as e:  # e.g. a target that is neither a folder nor a reachable Hub id
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the steps (the set-up, a resume's pending eval)
        code = 130
        kept = (f"{out} keeps its last checkpoint, and resume_from=auto continues from it"
                if (out / "latest").is_file() else "no checkpoint was written")
        print(f"\ninterrupted: {kept}", file=sys.stderr, flush=True)
    if fresh and out.is_dir() and not any(out.iterdir()):  # a refused run leaves no empty output_dir behind
        with contextlib.suppress(OSError):  # another rank removed it first
            out.rmdir()
    return code


def train(cfg) -> int:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed
    from tqdm import tqdm

    from dspine.checkpoint import load_draft, warm_start
    from dspine.model import DSpineDraftModel, count_parameters
    from dspine.target import TargetSpec, load_target

    # ---------------------------------------------------------------------------------------- init
    with config_errors("target"):  # an unsupported target (layer types, RoPE) is refused before any heavy work
        TargetSpec.from_pretrained(cfg.target, with_tokenizer=False).check_supported()
    cuda = torch.cuda.is_available()
    dev = run_config.resolve_device_settings(cfg, cuda)
    ranks_env = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks_env > 1 and not cuda:  # torch.distributed.run on a CPU machine: gloo ranks, as accelerate's --cpu makes
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # (without it accelerate sets up one process per rank)
    accelerator = Accelerator(mixed_precision=dev["mixed_precision"], gradient_accumulation_steps=cfg.grad_accum,
                              log_with="wandb" if cfg.report_to == "wandb" else None)
    rank, world, main_proc = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    if ranks_env > 1 and world == 1:  # each rank would train alone, all into one output_dir
        raise ConfigError(f"WORLD_SIZE={ranks_env} in the environment, but accelerate set up {world} process(es) "
                          f"({accelerator.distributed_type}; ACCELERATE_USE_CPU={os.environ.get('ACCELERATE_USE_CPU')}):"
                          " launch with `accelerate launch --num_processes N` (add --cpu on a machine without GPUs)")
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    zero3 = deepspeed and accelerator.state.deepspeed_plugin.zero_stage == 3
    dev = run_config.resolve_device_settings(cfg, cuda, zero3)  # compile_layers: auto depends on the ZeRO stage
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"config key 'output_dir': {out} is an existing file; give a folder")
    if (out / "config.json").is_file() and not (out / "config.yaml").is_file():  # the run's config.json would replace it
        raise ConfigError(f"config key 'output_dir': {out} holds a config.json that no training run wrote (a draft or "
                          "model folder?); give another folder")
    for key in ("draft_init", "init_from"):  # local folders that must exist (Hub ids are fetched later)
        path = getattr(cfg, key)
        # local: an explicit path, or one whose first folder exists here (runs/x), not a Hub id (org/name)
        local = path and (path.startswith((".", "/", "~")) or ("/" in path and Path(path.split("/")[0]).is_dir()))
        if local and not Path(path).expanduser().is_dir():
            raise ConfigError(f"config key '{key}': {path} is not a draft folder")
    if cfg.draft_init and Path(cfg.draft_init).expanduser().is_dir():  # a step-N folder given for its draft/
        run_config.load_draft_init(str(Path(cfg.draft_init).expanduser()))
    resume = resolve_resume(cfg, out)
    if resume is not None:
        check_resumed_config(resume, cfg, dev if main_proc else None)  # before anything is written: a refused
        # resume changes nothing (the speed-up note: once, on the main process)
    for key in ("train", "eval"):  # train may list several sources (train.data.split_sources)
        value = getattr(cfg, key)
        with config_errors(key):
            paths = split_sources(value) if key == "train" and value else [value]
        for path in paths:
            if path and not Path(path).exists():
                raise ConfigError(f"config key '{key}': {path} does not exist")
    if main_proc:
        out.mkdir(parents=True, exist_ok=True)
        print(yaml.safe_dump({**run_config.to_dict(cfg), "resolved": dev, "world_size": world}, sort_keys=False))
    if deepspeed:
        configure_deepspeed(accelerator, cfg)
    if cfg.report_to == "wandb":
        accelerator.init_trackers(cfg.wandb_project, config={**run_config.to_dict(cfg), **dev}, init_kwargs={
            "wandb": {"name": cfg.wandb_run_name, "tags": list(cfg.wandb_tags), "dir": str(out.resolve())}})
    accelerator.wait_for_everyone()

    # ---------------------------------------------------------------------------------------- data
    with config_errors("train" if cfg.feature_source == "online" else "feature_source"):
        rows = open_train_rows(cfg.train) if cfg.feature_source == "online" else open_rows(cfg.feature_source)
        if cfg.feature_source != "online" and not isinstance(rows, CaptureRows):
            raise ConfigError(f"config key 'feature_source': {cfg.feature_source} is not a train.capture folder")
        if cfg.feature_source == "online":
            check_trainable(rows, cfg.train)
        order = StepOrder(len(rows), cfg.micro_batch_size, cfg.grad_accum, world, cfg.seed)
    with config_errors("eval"):
        eval_rows = open_rows(cfg.eval) if cfg.eval else None
        if eval_rows is not None and len(eval_rows) == 0:
            raise ConfigError(f"config key 'eval': {cfg.eval} has no rows (eval=none turns evaluation off)")
        if eval_rows is not None:  # every row the evaluation reads, now rather than at the first eval step
            for i in range(min(len(eval_rows), cfg.eval_max_rows)):
                eval_rows.row(i)
    total_steps = cfg.max_steps or cfg.epochs * order.steps_per_epoch
    # the rows' identity, saved with every checkpoint: a resume over other rows (an edited, cut or reordered file at
    # the same path) would read another data order and is refused (check_resume)
    data_id = {"train_rows": len(rows), "train_digest": rows.metadata().get("data_digest")}
    if resume is not None:  # data order and step count, before the models load
        with config_errors("resume_from"):
            state = read_json_object(resume / "trainer_state.json", "the trainer state")
        check_resume(state, cfg, world, total_steps, data_id)

    # ---------------------------------------------------------------------------------------- models
    # The target is never handed to DeepSpeed: it must not be partitioned (docs/method.md §8.13).
    with whole_modules(accelerator if deepspeed else None), config_errors():
        target = load_target(cfg.target, dtype=dev["target_dtype"], device=accelerator.device)
        for key, src in (("train", rows), ("eval", eval_rows)):  # every row's ids were read at open
            top = getattr(src, "max_token", None)  # (largest id, where); None for a capture folder
            if top is not None and top[0] >= target.vocab_size:
                raise ConfigError(f"config key {key!r}: {top[1]}: field 'input_ids' holds token id {top[0]} >= the "
                                  f"target's vocabulary ({target.vocab_size} rows): tokenized for another target?")
        try:
            tokenizer = load_tokenizer(cfg.target)
        except (OSError, ValueError):
            tokenizer = None
        dcfg = run_config.draft_config(cfg, target, tokenizer)
        target.set_layer_ids(dcfg.target_layer_ids, dcfg.last_layer_features)
        if cfg.feature_source != "online":
            digest = open_sources(cfg.train).metadata()["data_digest"] if cfg.train else None
            try:
                rows.check(expected_fields(cfg, dev["target_dtype"], dcfg.target_layer_ids, digest,
                                           last_layer_features(dcfg, target.num_layers)))
            except ValueError as e:
                raise ConfigError(f"config key 'feature_source': {e}") from None
        set_seed(cfg.seed)
        draft = load_draft(cfg.draft_init, dtype=torch.float32) if cfg.draft_init else DSpineDraftModel(dcfg)
        draft = draft.float().train()
        if cfg.init_from and resume is None:
            with config_errors("init_from"):
                warm_start(draft, cfg.init_from)
    eos_ids = sorted(TargetSpec.from_adapter(target, tokenizer).eos_ids)
    alpha = run_config.MIX_ALPHA if cfg.distill_alpha is None else cfg.distill_alpha
    settings = StepSettings(dcfg.block_size, dev["attn"], cfg.loss_chunk_size, cfg.grad_clip, cfg.distill, alpha,
                            cfg.distill_temperature, ce_impl=dev["ce_impl"])
    batch_kw = dict(max_length=cfg.max_length, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                    gamma=cfg.gamma, anchors_per_seq=cfg.anchors_per_seq, pad_to_multiple=dev["pad_to_multiple"],
                    static_anchors=dev["attn"] == "flex")
    if main_proc:
        print(f"draft: {count_parameters(draft):,} parameters, {dcfg.num_hidden_layers} layers, block "
              f"{dcfg.block_size}, injection {dcfg.injection}, target layers {dcfg.target_layer_ids}, mask "
              f"{dcfg.mask_token_id}; data: {len(rows)} rows, {order.steps_per_epoch} steps/epoch, "
              f"global batch {order.global_batch}, {total_steps} steps; {world} rank(s), {accelerator.distributed_type}")

    # ---------------------------------------------------------------------------------------- optimizer
    fused = dev["adamw_impl"] == "fused"
    optimizer = make_optimizer(draft, cfg.lr, cfg.weight_decay, cfg.betas, fused=fused)
    scheduler = make_scheduler(optimizer, total_steps, cfg.warmup_ratio, cfg.schedule, cfg.min_lr_ratio)
    draft, optimizer = accelerator.prepare(draft, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    start, skipped_total = 0, 0
    if resume is not None:
        load_resume_state(accelerator, resume)
        start, skipped_total = state["step"], state["skipped_rows"]
        if main_proc:
            print(f"resumed from {resume}: step {start}, epoch {state['epoch']}, index {state['index']}")
    # the inner torch AdamW (also under DeepSpeed) on the chosen kernel after a resume too: a loaded state_dict
    # brings the checkpoint's param-group flags, and the `step` state must sit where the kernel reads it
    # (on the device for fused)
    set_fused_adam(optimizer, fused)
    # after prepare: the forwards of the modules that run (DDP/DeepSpeed wrap only the draft as a whole)
    compiled = compile_layers(target, accelerator.unwrap_model(draft), dev["compile_layers"],
                              length_buckets(cfg.max_length, dev["pad_to_multiple"]))
    pending = resume is not None and eval_rows is not None and state.get("eval_pending", False)
    with config_errors():  # a metrics row that is not one: one line naming the file
        if main_proc:
            run_config.save(cfg, out, extra={"resolved": dev, "world_size": world})
            truncate_jsonl(out / "metrics.jsonl", start, drop_eval=pending)
        if cfg.log_samples:
            truncate_jsonl(out / f"samples-rank{rank}.jsonl", start)
    accelerator.wait_for_everyone()

    # ---------------------------------------------------------------------------------------- loop
    metrics = open(out / "metrics.jsonl", "a") if main_proc else None
    samples = open(out / f"samples-rank{rank}.jsonl", "a") if cfg.log_samples else None
    stop = min(total_steps, cfg.stop_after_steps or total_steps)
    bar = tqdm(total=total_steps, initial=start, disable=not main_proc, dynamic_ncols=True)
    new_window = lambda: {"loss": [], "grad_norm": [], "tokens": 0, "seconds": 0.0, "data_wait_s": 0.0, "blocks": 0,
                          "stats": LossStats.zeros(dcfg.block_size)}
    window = new_window()  # steps since the last metrics row (a checkpoint's: the main process's)
    if resume is not None and "window" in state:
        window = {**state["window"], "stats": LossStats.from_vector(torch.tensor(state["window"]["stats"],
                                                                                 dtype=torch.float64))}

    def log(row: dict) -> None:
        row = finite_or_none(row)  # NaN (e.g. a slot with no supervised rows yet) is not valid JSON
        if metrics is not None:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        flat = {k: v for k, v in row.items() if not isinstance(v, list) and k != "step"}
        for k, v in row.items():
            if isinstance(v, list):
                flat.update({f"{k}/{i + 1}": x for i, x in enumerate(v)})
        accelerator.log(flat, step=row["step"])

    def run_eval(n: int) -> None:
        res_eval = evaluate(accelerator, draft, target, eval_rows, cfg, batch_kw, settings, dcfg, eos_ids, zero3,
                            compiled=compiled)
        log({"step": n, **res_eval})
        if main_proc:
            bar.write(f"step {n}: eval loss {res_eval['eval/loss']:.4f}, tau_sim {res_eval['eval/tau_sim']:.3f}"
                      + (f", tau_real {res_eval['eval/tau_real']:.3f}" if "eval/tau_real" in res_eval else "")
                      + f", kl {res_eval['eval/kl']:.4f}, tau_sim_agree {res_eval['eval/tau_sim_agree']:.3f}"
                      + (f", tau_sim_sample {res_eval['eval/tau_sim_sample']:.3f}" if "eval/tau_sim_sample" in res_eval
                         else "")
                      + f" ({res_eval['eval/seconds']:.1f} s, tau_real {res_eval['eval/tau_real_seconds']:.1f} s)")

    if pending:  # the eval of an interrupted step, on its weights (the checkpoint's), before the next step
        run_eval(start)
    steps = StepBatches(rows, order, range(start, stop), rank, cfg.seed, batch_kw, target.vocab_size, cfg.train)
    loader = iter(step_loader(steps, dev["data_workers"], pin=accelerator.device.type == "cuda"))
    interrupt = GracefulInterrupt(main_proc)
    interrupted = False
    try:  # the handlers come back even when a step raises (a second Ctrl-C, a bad row): in-process callers keep Ctrl-C
        for step in range(start, stop):
            t0 = time.perf_counter()
            try:
                batches = next(loader)
            except ValueError as e:  # a bad row, or token ids outside the target's vocabulary
                # a worker's error arrives wrapped with its traceback; the last line is the message
                msg = str(e).strip().splitlines()[-1].removeprefix("ValueError: ")
                raise ConfigError(f"config key 'train': {msg}") from None
            window["data_wait_s"] += time.perf_counter() - t0
            window["blocks"] += sum(int((b.anchors >= 0).sum()) for b in batches)
            res = train_step(accelerator, draft, target, optimizer, scheduler, batches, settings)
            n = step + 1
            window["seconds"] += time.perf_counter() - t0
            window["loss"].append(res["loss"])
            window["grad_norm"].append(res["grad_norm"])
            window["tokens"] += res["tokens"]
            window["stats"].add(res["stats"])
            skipped_total += res["skipped"]
            if samples is not None:
                samples.write(json.dumps({"step": n, "rows": [i for b in batches for i in b.row_ids]}) + "\n")
                samples.flush()
            bar.update(1)
            interrupted = interrupt.agreed(accelerator)  # every rank stops after the same step
            if n % cfg.log_every == 0 or n == total_steps:  # a stop keeps the window in its checkpoint
                pos = order.position(step)
                row = {"step": n, "epoch": pos.epoch, "loss": sum(window["loss"]) / len(window["loss"]),
                       "lr": res["lr"],
                       "grad_norm": sum(window["grad_norm"]) / len(window["grad_norm"]),
                       "tokens_per_s": window["tokens"] / max(window["seconds"], 1e-9),
                       "tokens": window["tokens"], "anchor_blocks": window["blocks"],
                       "step_s": window["seconds"] / len(window["loss"]),
                       "anchor_blocks_per_s": window["blocks"] / max(window["seconds"], 1e-9),  # this rank's
                       "data_wait_s": window["data_wait_s"] / len(window["loss"]),
                       "train/acc_at_pos": window["stats"].accuracy, "skipped_rows": skipped_total}
                row.update(soft_metrics(window["stats"], "train/"))
                log(row)
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
                window = new_window()
            due = eval_rows is not None and (n == total_steps or (cfg.eval_every and n % cfg.eval_every == 0))
            if due and not interrupted:  # interrupted: saved as pending, run by the resume (a fast stop)
                run_eval(n)
            if n == stop or interrupted or (cfg.save_every and n % cfg.save_every == 0):
                pos = order.position(n)  # where the next step starts reading
                state = {"step": n, "epoch": pos.epoch, "index": pos.index, "skipped_rows": skipped_total,
                         "world_size": world, "total_steps": total_steps, "eval_pending": bool(due and interrupted),
                         "window": {**window, "stats": window["stats"].to_vector().tolist()},
                         **{k: getattr(cfg, k) for k in RESUME_KEYS}, **data_id}
                save_checkpoint(accelerator, draft, dcfg, cfg, dev, n, state, zero3)
            if interrupted:
                break
    finally:
        interrupt.restore()
    bar.close()
    for fh in (metrics, samples):
        if fh is not None:
            fh.close()
    accelerator.end_training()
    if interrupted and main_proc:
        print(f"interrupted: stopped after step {n}, saved {out / f'step-{n}'}; the same command with "
              "resume_from=auto continues exactly", file=sys.stderr)
    code = 130 if interrupted else 0
    if world > 1:  # leave while this frame still holds the run's objects (leave_rank)
        del loader  # but first end the data workers (the iterator's teardown joins them): none outlives its rank
        leave_rank(code)
    return code


class GracefulInterrupt:
    """The first Ctrl-C (SIGINT) or SIGTERM ends training after the step in progress, with a checkpoint of that step
    (nothing is lost; ``resume_from=auto`` continues exactly); another one ``SAME_REQUEST_S`` or more later aborts at
    once. One sooner is the same request reaching the process twice: a terminal's Ctrl-C under ``accelerate launch``
    reaches the rank, and accelerate then sends SIGTERM to every process of the launch (and SIGKILL 5 s later, which
    nothing can outlast: the step in progress and its checkpoint must fit in that, or signal this process directly).
    A scheduler's SIGTERM before its kill gets the same checkpoint.

    With several ranks the flag is summed over them after every step (one 8-byte all-reduce), so all
    ranks stop after the same step and save together. Installed only in the main thread."""

    SAME_REQUEST_S = 2.0  # a second signal sooner than this after the first is the same request (the class docstring)
    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, announce: bool):
        self.flag, self.announce, self.previous, self.first = False, announce, {}, None
        for name in self.SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: the signals keep their default behaviour
                self.previous[name] = signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.flag:
            if now - self.first < self.SAME_REQUEST_S:
                return
            raise KeyboardInterrupt
        self.flag, self.first = True, now
        if self.announce:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(f"\n{what}: stopping after this step and saving a checkpoint (Ctrl-C again aborts)",
                  file=sys.stderr, flush=True)

    def agreed(self, accelerator) -> bool:
        if accelerator.num_processes == 1:
            return self.flag
        return bool(reduce_sum(accelerator, torch.tensor([float(self.flag)], dtype=torch.float64))[0] > 0)

    def restore(self) -> None:
        for name, handler in self.previous.items():
            signal.signal(getattr(signal, name), handler)


# -------------------------------------------------------------------------------------------- eval


def eval_prompts(rows, count: int, min_tokens: int) -> list[list[int]]:
    """Prompts for tau_real: each row up to its first supervised token (at least ``min_tokens``)."""
    prompts = []
    for i in range(min(count, len(rows))):
        r = rows.row(i)
        first = next((j for j, m in enumerate(r["loss_mask"]) if m), len(r["loss_mask"]))
        prompts.append(r["input_ids"][: max(first, min_tokens, 1)])
    return prompts


def soft_metrics(stats: LossStats, prefix: str) -> dict:
    """Hard-label CE, KL(p_target ‖ q_draft) and per-slot argmax agreement with the target, when the
    statistics hold the target's distribution (``distill`` kl/mix, and every eval); else {}."""
    if not stats.soft:
        return {}
    w = stats.weight_sum or float("nan")
    return {f"{prefix}ce": stats.ce_sum / w, f"{prefix}kl": stats.kl_sum / w,
            f"{prefix}argmax_agree_at_pos": stats.agreement}


# A row without supervised tokens (no anchors, weight 0): fills the last eval micro-batch up to the training shape.
EMPTY_ROW = {"input_ids": [0], "loss_mask": [0]}


def evaluate(accelerator, draft, target, eval_rows, cfg, batch_kw, settings, dcfg, eos_ids, zero3,
             batch_verify: bool = True, pad_batches: bool | None = None, compiled=()) -> dict:
    """Held-out loss, teacher-forced accuracy per slot, tau_sim and tau_real; also the hard-label CE, the KL
    to the target's distribution, the argmax agreement per slot and tau_sim_agree (tau_sim from it), and
    the sampling overlap Σ_v min(p_v, q_v) per slot with tau_sim_sample (tau_sim from it: the τ of
    sampled drafting with rejection sampling, target and draft at ``distill_temperature`` without top-k /
    top-p, teacher forced; for choosing recipes at T > 0).

    Per-slot counts are summed over ranks before dividing (docs/method.md §8.9); anchors are drawn from a
    fixed generator so evals at different steps see the same blocks. tau_real decodes
    ``eval_prompts`` prompts greedily with :class:`dspine.reference.ReferenceDecoder` on rank 0, all
    prompts in one target forward per step (``batch_verify``, where the target allows it; False = one
    forward per prompt, the decoder's default; same tokens up to fp rounding).

    ``pad_batches`` (default: on the compiled flex path, ``batch_kw["static_anchors"]``) fills the last
    micro-batch with :data:`EMPTY_ROW` up to ``micro_batch_size`` rows, so evaluation runs the training
    shapes and compiles flex attention / block masks for no new batch size (an empty row adds nothing to
    any sum; the target's GEMMs over more rows may round differently in bf16).

    Wall-clock seconds (this rank's; the loss part ends after the all-reduce): ``eval/seconds`` in all,
    ``eval/loss_seconds`` (loss, tau_sim, KL over the held-out rows) and ``eval/tau_real_seconds`` (the
    decode on rank 0 and the wait of the other ranks for it; 0 without ``eval_prompts``).

    ``compiled``: the trainer's :class:`train.speed.Forwards` (``compile_layers``); the loss part runs them
    compiled (training shapes), the tau_real decode eager (its lengths grow every step: one compile each)."""
    from dspine.reference import ReferenceDecoder

    t0 = time.perf_counter()
    rank, world = accelerator.process_index, accelerator.num_processes
    pad_batches = batch_kw.get("static_anchors", False) if pad_batches is None else pad_batches
    n = min(len(eval_rows), cfg.eval_max_rows)
    mine = list(range(rank, n - n % world, world))
    stats = LossStats.zeros(dcfg.block_size)
    with torch.no_grad(), torch.profiler.record_function("eval/loss"):  # labels for benchmarks/train/bench_eval.py
        for m, i in enumerate(range(0, len(mine), cfg.micro_batch_size)):
            ids = mine[i: i + cfg.micro_batch_size]
            fill = cfg.micro_batch_size - len(ids) if pad_batches else 0
            b = make_batch([eval_rows.row(j) for j in ids] + [EMPTY_ROW] * fill, ids + [-1] * fill,
                           generator=anchor_generator(cfg.seed, -1, rank, m), **batch_kw)
            stats.add(micro_loss(draft, target, b.to(accelerator.device), settings, measure_target=True)[1])
    stats = LossStats.from_vector(reduce_sum(accelerator, stats.to_vector()))
    acc = stats.accuracy
    tau, at_pos = tau_sim(acc)
    out = {"eval/loss": stats.loss_sum / stats.weight_sum if stats.weight_sum else float("nan"),
           "eval/acc_at_pos": acc, "eval/accept_at_pos": at_pos, "eval/tau_sim": tau,
           **soft_metrics(stats, "eval/")}
    out["eval/tau_sim_agree"] = tau_sim(stats.agreement)[0]  # T = 0 acceptance tests the target's argmax
    if stats.overlap_rate is not None:  # T > 0: a sampled draft token passes with probability Σ min(p, q)
        out["eval/overlap_at_pos"] = stats.overlap_rate
        out["eval/tau_sim_sample"] = tau_sim(stats.overlap_rate)[0]
    t_loss = time.perf_counter()
    if cfg.eval_prompts:
        from dspine.sampling import SamplingParams

        model = full_draft(accelerator, draft, dcfg, zero3)
        real = None
        if accelerator.is_main_process:
            prompts = eval_prompts(eval_rows, cfg.eval_prompts, cfg.eval_prompt_min_tokens)
            model.eval()
            with eager_forwards(compiled), accelerator.autocast(), torch.profiler.record_function("eval/tau_real"):
                res = ReferenceDecoder(target, model, eos_ids, batch_verify=batch_verify and
                                       ReferenceDecoder.can_batch_verify(target)).generate(
                    prompts, SamplingParams(temperature=0.0, max_new_tokens=cfg.eval_max_new_tokens))
            model.train()
            real = {"eval/tau_real": res.stats.tau, "eval/real_accept_at_pos": res.stats.accept_at_pos,
                    "eval/real_steps": res.stats.steps}
        accelerator.wait_for_everyone()
        if real is not None:
            out.update(real)
    end = time.perf_counter()
    out.update({"eval/seconds": end - t0, "eval/loss_seconds": t_loss - t0, "eval/tau_real_seconds": end - t_loss})
    return out


# -------------------------------------------------------------------------------------------- checkpoint

RESUME_KEYS = ("seed", "micro_batch_size", "grad_accum", "train", "feature_source", "max_length", "anchors_per_seq")


def full_draft(accelerator, draft, dcfg, zero3: bool):
    """The draft with full weights on rank 0 (None elsewhere under ZeRO-3). Collective under ZeRO-3:
    every rank must call it (the parameters are gathered; needs ``zero3_save_16bit_model``)."""
    from dspine.model import DSpineDraftModel

    if not zero3:
        return accelerator.unwrap_model(draft)
    state = accelerator.get_state_dict(draft)
    if not accelerator.is_main_process:
        return None
    model = DSpineDraftModel(dcfg)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(accelerator.device)


def save_checkpoint(accelerator, draft, dcfg, cfg, dev, step: int, state: dict, zero3: bool) -> Path:
    """``step-N/{state,draft,trainer_state.json,config.yaml}``, then the ``latest`` pointer, then rotation."""
    from dspine.checkpoint import portable_path, save_draft
    from dspine.io import atomic_write_json

    out = Path(cfg.output_dir)
    ckpt = out / f"step-{step}"
    accelerator.wait_for_everyone()
    accelerator.save_state(str(ckpt / "state"))
    model = full_draft(accelerator, draft, dcfg, zero3)
    if accelerator.is_main_process:
        dtype = torch.bfloat16 if cfg.save_dtype == "bf16" else torch.float32
        train = ",".join(portable_path(p) for p in split_sources(cfg.train))  # save_draft makes one path portable
        save_draft(model, ckpt / "draft", dtype=dtype, metadata={
            "target": cfg.target, "step": str(step), "injection": dcfg.injection, "train": train})
        run_config.save(cfg, ckpt, extra={"resolved": dev, "world_size": accelerator.num_processes})
        atomic_write_json(ckpt / "trainer_state.json", state, allow_nan=True)  # a NaN loss in the window
        tmp = out / "latest.tmp"
        tmp.write_text(ckpt.name + "\n")
        os.replace(tmp, out / "latest")
        rotate_checkpoints(out, step, cfg.keep_last)
    accelerator.wait_for_everyone()
    return ckpt


def rotate_checkpoints(out: Path, step: int, keep_last: int) -> list[Path]:
    """Deletes all but the ``keep_last`` newest ``step-N`` folders of ``out`` after ``step-{step}`` was saved (0:
    none deleted) and returns the deleted ones. Newest means this run's lineage first: a folder with N > ``step`` is
    left from a run abandoned by resuming an earlier checkpoint (the run overwrites it on reaching N), so it counts
    as older than every folder with N ≤ ``step``; among those, by N. The folder just saved is never deleted (sorted
    by N alone, resuming step-200 beside an abandoned step-300 with keep_last 1 deleted the new step-213 that
    ``latest`` names: newcomer review, 2026-12-05)."""
    if not keep_last:
        return []
    steps = sorted(((int(p.name[5:]) <= step, int(p.name[5:])), p) for p in out.glob("step-*") if p.name[5:].isdigit())
    gone = [p for _, p in steps[: -keep_last]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def resolve_resume(cfg, out: Path) -> Path | None:
    """The checkpoint folder to resume from, or None. Raises ConfigError for a missing checkpoint
    or when ``resume_from: none`` would overwrite existing checkpoints."""
    latest = out / "latest"
    if cfg.resume_from == "auto":
        if not latest.is_file():
            return None
        ckpt = out / latest.read_text().strip()
        missing = [n for n in ("trainer_state.json", "state") if not (ckpt / n).exists()]
        if missing:
            raise ConfigError(f"{latest} points to {ckpt}, an incomplete checkpoint (no {' or '.join(missing)}); "
                              "point it to a complete step-N folder or delete the incomplete one")
        return ckpt
    if cfg.resume_from == "none":
        if latest.is_file():
            raise ConfigError(f"resume_from=none but {out} already holds checkpoints ({latest}); "
                              "use resume_from=auto or another output_dir")
        return None
    ckpt = Path(cfg.resume_from)
    if not (ckpt / "trainer_state.json").is_file() or not (ckpt / "state").is_dir():
        what = "is not a step-N checkpoint (trainer_state.json + state/)" if ckpt.exists() else "does not exist"
        raise ConfigError(f"config key 'resume_from': {ckpt} {what}")
    return ckpt


# Keys that may change between a checkpoint and its resumed run; any other change breaks the exact
# continuation (optimizer, schedule, model or data) and is refused. The step speed-ups (ce_impl, adamw_impl,
# compile_layers) run the same math with other kernels: a change moves only the rounding (a bitwise
# continuation needs the same values), and turns one off when it fails on a machine.
RESUME_MUTABLE = {
    "resume_from", "output_dir", "max_steps", "epochs", "stop_after_steps", "save_every", "keep_last",
    "save_dtype", "eval", "eval_every", "eval_max_rows", "eval_prompts", "eval_prompt_min_tokens",
    "eval_max_new_tokens", "log_every", "log_samples", "report_to", "wandb_project", "wandb_run_name", "wandb_tags",
    "ce_impl", "adamw_impl", "compile_layers",
}


@contextlib.contextmanager
def config_errors(key: str | None = None):
    """Report a ``ValueError`` of the config/data/checkpoint checks as a :class:`ConfigError` (an
    ``error:`` line naming ``key``, no traceback). Not used around the training loop."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config key {key!r}: {e}" if key else str(e)) from None


def finite_or_none(x):
    """Replace NaN/inf floats (nested in dicts/lists) by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_or_none(v) for v in x]
    return x


def check_trainable(rows, path: str, limit: int = 2000) -> None:
    """Fail early when a source has no rows or its first ``limit`` rows hold no anchor (loss_mask[p] =
    loss_mask[p+1] = 1). Each part of a :class:`train.data.ConcatRows` is checked on its own: a part with
    nothing to train on is a wrong path in the list. Raises ConfigError naming 'train' and the source."""
    sources = list(zip(rows.paths, rows.parts)) if isinstance(rows, ConcatRows) else [(path, rows)]
    for name, part in sources:
        if len(part) == 0:
            raise ConfigError(f"config key 'train': {name} has no rows; nothing to train on")
        n = min(len(part), limit)
        masks = (part.row(i)["loss_mask"] for i in range(n))
        if not any(any(a and b for a, b in zip(m[:-1], m[1:])) for m in masks):
            raise ConfigError(f"config key 'train': none of the first {n} rows of {name} has two consecutive "
                              "supervised tokens (loss_mask), so there is nothing to train on")


SPEEDUP_KEYS = ("ce_impl", "adamw_impl", "compile_layers")


def check_resumed_config(ckpt: Path, cfg, resolved: dict | None = None) -> None:
    """Refuse a resume whose run config differs from the checkpoint's in a key outside RESUME_MUTABLE; print a
    note when the resolved step speed-ups (``resolved``: this run's, SPEEDUP_KEYS) differ from the ones the
    checkpoint ran with (same math, other rounding: the continuation is no longer bitwise)."""
    saved_file = ckpt / "config.json"
    if not saved_file.is_file():
        return
    with config_errors("resume_from"):
        saved = read_json_object(saved_file, "the checkpoint's run config")
    now = run_config.to_dict(cfg)
    if saved.get("distill") in ("ce", "kl") and saved.get("distill_alpha") == run_config.MIX_ALPHA:
        saved["distill_alpha"] = None  # the old default, saved before distill_alpha became None = unset
    changed = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in now.items()
               if k not in RESUME_MUTABLE and k in saved and saved[k] != v]
    if changed:
        raise ConfigError(f"resume from {ckpt}: the run config changed ({'; '.join(changed)}); an exact continuation "
                          "needs the checkpoint's values — restore them, or start a new output_dir with init_from")
    # a checkpoint from before the options ran what they now call eager / default / none
    ran = {"ce_impl": "eager", "adamw_impl": "default", "compile_layers": "none", **(saved.get("resolved") or {})}
    if saved.get("distill", "ce") != "ce":  # kl / mix never ran the hard-label CE's chunk math, whatever it recorded
        ran["ce_impl"] = "eager"
    moved = [f"{k}: {ran[k]} -> {resolved[k]}" for k in SPEEDUP_KEYS if resolved is not None and ran[k] != resolved[k]]
    if moved:
        print(f"note: resume from {ckpt}: step speed-ups differ from the checkpoint's run ({'; '.join(moved)}): the "
              "same math with other rounding, so the continuation is not bitwise; set them to the checkpoint's values "
              "for an exact one", flush=True)


def check_resume(state: dict, cfg, world: int, total_steps: int, data_id: dict | None = None) -> None:
    """Exact continuation needs the same data order: refuse a change of the keys that define it, and of the
    training rows themselves (``data_id``: ``train_rows``, their count, and ``train_digest``, the source's
    ``data_digest``; checkpoints written before these keys existed skip that check).

    Raises:
        ConfigError: naming the key, the checkpoint's value and this run's.
    """
    have = {**{k: getattr(cfg, k) for k in RESUME_KEYS}, "world_size": world}
    for key, value in (data_id or {}).items():
        if key in state and state[key] != value:
            raise ConfigError(f"resume: the training rows changed since the checkpoint ({key} was {state[key]!r}, now "
                              f"{value!r}, train={cfg.train}); an exact continuation needs the same rows in the same "
                              "order (restore the data, or start a new output_dir with init_from)")
    for key, value in have.items():
        if key in state and state[key] != value:
            raise ConfigError(f"resume: {key} was {state[key]!r} in the checkpoint but is {value!r} now; an exact "
                              "continuation needs the same value (or start a new output_dir with init_from)")
    if state.get("step", 0) > total_steps:
        raise ConfigError(f"resume: the checkpoint is at step {state['step']} but this run has {total_steps} total "
                          f"steps (max_steps={cfg.max_steps}, epochs={cfg.epochs}); raise max_steps to at least "
                          f"{state['step']}, or resume from an earlier step-N folder")
    if state.get("total_steps") not in (None, total_steps):
        print(f"warning: resuming with {total_steps} total steps instead of {state['total_steps']}: "
              "the learning-rate schedule changes", file=sys.stderr)


def load_resume_state(accelerator, ckpt: Path) -> None:
    """``accelerator.load_state(ckpt/state)``; a corrupt file there (e.g. a truncated model.safetensors)
    becomes a ConfigError naming the checkpoint and the other step-N folders to resume from."""
    import pickle

    from safetensors import SafetensorError

    try:
        accelerator.load_state(str(ckpt / "state"))
    except (SafetensorError, EOFError, pickle.UnpicklingError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "PytorchStreamReader" not in str(e):  # torch.load of a truncated .bin/.pt
            raise
        others = sorted((p for p in ckpt.parent.glob("step-*") if p.name[5:].isdigit() and p != ckpt
                         and (p / "trainer_state.json").is_file()), key=lambda p: int(p.name[5:]))
        hint = (f"resume from an earlier one with resume_from=<step-N folder> (available: "
                f"{', '.join(str(p) for p in others)})" if others else "no other step-N folder is there to resume from")
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"resume from {ckpt}: cannot read its state/ ({type(e).__name__}: {msg}); the checkpoint is "
                          f"damaged (a truncated file?): {hint}") from None


def open_train_rows(spec: str):
    """:func:`train.data.open_sources` of the ``train`` key (one path or a comma-separated list), with a
    hint for a folder of cache folders or a ``data.pack`` archive folder. Raises ConfigError naming 'train'."""
    try:
        return open_sources(spec)
    except FileNotFoundError as e:
        paths = split_sources(spec)
        as_value = (lambda x: f"train={x}") if len(paths) == 1 else (lambda x: f"{x} in the train list")
        hint = ""
        for p in map(Path, paths):  # the hint of the first part that has one
            # a dot folder is a build in progress or killed (data.tokenize's .<key>.tmp-<pid>): not a cache to suggest
            subs = sorted(q.name for q in p.iterdir() if not q.name.startswith(".") and (q / "data.arrow").is_file()
                          ) if p.is_dir() else []
            if subs:
                hint = (f"; {p} holds cache folders: give the <key> subfolder, e.g. {as_value(p / subs[0])} "
                        f"(of {', '.join(subs)})")
            elif p.is_dir() and (p / "pack.json").is_file():
                hint = (f"; {p} is a data.pack archive: rebuild the cache first with `python -m data.pack import "
                        f"--parts {p} --out CACHE_FOLDER` and give {as_value('CACHE_FOLDER')}")
            if hint:
                break
        raise ConfigError(f"config key 'train': {e}{hint}") from None


def truncate_jsonl(path: Path, last_step: int, drop_eval: bool = False) -> None:
    """Drop rows logged after ``last_step`` (a run killed after its last checkpoint logged them) and, ``drop_eval``,
    the eval row of ``last_step`` (the checkpoint's pending eval, run by an earlier resume of it and run again). A
    last line cut off by a kill is dropped; raises ValueError naming the file and line for any other row that is not
    a JSON object with a ``step``."""
    if not path.is_file():
        return
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    keep = []
    for i, line in lines:
        try:
            r = json.loads(line)
            step = r["step"]
        except (ValueError, TypeError, KeyError):
            if i == lines[-1][0]:
                break
            raise ValueError(f"{path}:{i}: not a metrics row (a JSON object with a 'step'): {line[:60]!r}") from None
        if step < last_step or step == last_step and not (drop_eval and "eval/loss" in r):
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------- launch, DeepSpeed


def relaunch_cpu_ranks(argv: list[str]) -> int | None:
    """Start the CPU ranks of an ``accelerate launch`` of N > 1 processes that ran this script once, and wait for them.

    accelerate's launcher runs a CPU script once and leaves multi-process CPU runs to mpirun; it then exports
    ``MASTER_ADDR`` (and ``ACCELERATE_USE_CPU``) with no ``RANK``, and this process re-launches itself through
    ``torch.distributed.run`` (gloo ranks, which accelerate detects as MULTI_CPU; :func:`run_ranks`). N is the
    launcher's, resolved as accelerate does (:func:`launcher_processes`): ``--num_processes``, else its
    ``--config_file``, else, without ``--cpu``, accelerate's default config file. A launch without ``--cpu`` on a
    machine without CUDA runs its N ranks on the CPU too (accelerate's own choice there; the ranks get
    ``ACCELERATE_USE_CPU=true``). ``main_process_port``: given (not 0), the ranks meet at that port; not given or
    0 (accelerate's default, 29500, is then in ``MASTER_PORT``), at a port the operating system picks when the
    rendezvous store binds (``torch.distributed.run --standalone``), so two runs on one machine never meet at the
    same port and no port is picked by one process and bound later by another.

    Returns the ranks' exit code (128 + the signal's number when this process was signalled), or None when this
    process is already a rank, was not started by accelerate's simple launcher, or N <= 1.

    Raises:
        ConfigError: a launch of N > 1 processes that would otherwise train as one rank: naming the setting
            (``num_processes``, ``num_machines``) and its value, and where it came from — one visible GPU
            without ``--cpu`` (accelerate starts the script once), more than one machine (this relaunch is for one
            machine), or a launcher whose command line cannot be read.
    """
    env = os.environ
    if "ACCELERATE_USE_CPU" not in env:  # not accelerate's simple launcher
        return None
    if any(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        return None
    # accelerate exports MASTER_ADDR for a launch of several processes only; one of fewer than one runs as one
    several = "MASTER_ADDR" in env
    try:
        launcher = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError as e:
        if not several:
            return None
        raise ConfigError(f"accelerate launch exported MASTER_ADDR={env['MASTER_ADDR']} (a launch of several "
                          f"processes) without starting them, and its command line cannot be read to count them "
                          f"({e}); start the ranks with `python -m torch.distributed.run --nproc_per_node N "
                          "train/distill.py ...`, or unset MASTER_ADDR for one process") from None
    if not any("accelerate" in a for a in launcher[:3]):  # MASTER_ADDR and ACCELERATE_USE_CPU from elsewhere
        return None
    values, sources = launcher_processes(launcher)
    n, machines, port = values["num_processes"], values["num_machines"], values["main_process_port"]
    if not several:
        if n < 1:
            raise ConfigError(f"num_processes = {n} ({sources['num_processes']}): give at least 1 process")
        return None
    if n <= 1 and machines <= 1:
        return None
    if machines > 1:
        raise ConfigError(f"num_machines = {machines} ({sources['num_machines']}): train/distill.py starts the CPU "
                          "ranks of one machine only; start them on each machine with "
                          "`python -m torch.distributed.run --nnodes ... train/distill.py ...`")
    rank_env = None
    if env["ACCELERATE_USE_CPU"].lower() not in ("true", "1"):  # launched without --cpu
        if torch.cuda.is_available():
            raise ConfigError(f"num_processes = {n} ({sources['num_processes']}), but accelerate launch started "
                              f"train/distill.py once: {torch.cuda.device_count()} GPU(s) visible and no --multi_gpu; "
                              f"use --num_processes 1 on one GPU, --multi_gpu with a GPU per rank, or --cpu for "
                              f"{n} CPU ranks")
        print(f"note: no CUDA GPU: the {n} ranks of num_processes = {n} ({sources['num_processes']}) run on the "
              "CPU, as with --cpu", file=sys.stderr, flush=True)
        rank_env = {**env, "ACCELERATE_USE_CPU": "true"}
    port = None if str(port) == "0" else port  # 0: any free port, what --standalone does (a static 0 never meets)
    meet = (["--standalone"] if port is None else
            [f"--master_addr={env['MASTER_ADDR']}", f"--master_port={env.get('MASTER_PORT', port)}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", *meet,
           str(Path(__file__).resolve()), *argv]
    return run_ranks(cmd, rank_env)


def launcher_processes(launcher: list[str]) -> tuple[dict, dict]:
    """``num_processes``, ``num_machines`` and ``main_process_port`` of an ``accelerate launch`` command line (its
    ``/proc/PID/cmdline`` split at NULs), resolved as accelerate's ``_validate_launch_command`` does: the launcher's
    own option, else its ``--config_file``, else — without ``--cpu``, which skips it — accelerate's default config
    file (``$HF_HOME/accelerate/default_config.yaml``) when it exists. Only the options before this script's path
    are read (the ones after it are the script's).

    Returns:
        ``(values, sources)``: the counts as ints (unset: 1), the port as given (unset: None); and for each key where
        its value came from (``--num_processes``, ``--config_file F``, ``accelerate's default config file F``,
        ``unset``), for messages.

    Raises:
        ConfigError: an unreadable or malformed config file, or a count that is not an integer (naming the key, the
            value and where it came from).
    """
    here = Path(__file__).resolve()
    end = next((i for i, a in enumerate(launcher) if a.endswith(".py") and Path(a).resolve() == here), len(launcher))
    opts = launcher[:end]
    path, what = launcher_option(opts, "config_file"), None
    if path is not None:
        what = f"--config_file {path}"
    elif "--cpu" not in opts:
        from accelerate.commands.config.config_args import default_config_file

        if Path(default_config_file).is_file():
            path, what = default_config_file, f"accelerate's default config file {default_config_file}"
    file_cfg = {}
    if path is not None:
        try:
            file_cfg = yaml.safe_load(Path(path).expanduser().read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{what}: {e}") from None
        if not isinstance(file_cfg, dict):
            raise ConfigError(f"{what}: top level must be a mapping of keys to values")
    values, sources = {}, {}
    for key in ("num_processes", "num_machines", "main_process_port"):
        value = launcher_option(opts, key)
        values[key], sources[key] = ((value, f"--{key}") if value is not None else
                                     (file_cfg[key], what) if file_cfg.get(key) is not None else (None, "unset"))
    for key in ("num_processes", "num_machines"):
        try:
            values[key] = 1 if values[key] is None else int(values[key])
        except (TypeError, ValueError):
            raise ConfigError(f"{key} = {values[key]!r} ({sources[key]}): expected an integer") from None
    return values, sources


RELAYED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def run_ranks(cmd: list[str], env: dict | None = None) -> int:
    """Run ``cmd`` (``torch.distributed.run`` and its ranks) to its end; return its exit code, or 128 + the number of
    the first signal this process got. No rank outlives this process:

    * SIGTERM, SIGINT or SIGHUP sent here is passed on to the agent, which passes it to the ranks (SIGINT, SIGTERM:
      every rank ends after the step in progress with a checkpoint, :class:`GracefulInterrupt`) and kills those left
      after its shutdown timeout (30 s); a second signal ``GracefulInterrupt.SAME_REQUEST_S`` or more after the first
      kills the agent and every rank at once (SIGKILL; a sooner one is the same request, e.g. accelerate's SIGTERM
      after a terminal's Ctrl-C). Whatever of the
      agent's process tree (the ranks run in sessions of their own, so not in its process group) outlives the
      agent after a signal is killed.
    * the agent runs in a session of its own, so a terminal's Ctrl-C reaches it once (through this process), and on
      Linux it gets SIGTERM when this process dies, also of a SIGKILL (``prctl(PR_SET_PDEATHSIG)``).
    """
    import psutil

    received: list[int] = []
    at: list[float] = []  # when each signal came (time.monotonic)
    tree: dict[int, psutil.Process] = {}  # the agent and its descendants seen at a signal
    proc = None

    def remember() -> None:
        try:
            agent = psutil.Process(proc.pid)
            for p in (agent, *agent.children(recursive=True)):
                tree.setdefault(p.pid, p)
        except psutil.Error:  # the agent has ended
            pass

    def kill_tree() -> None:
        for p in tree.values():
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks that the pid is still the process it saw
        psutil.wait_procs(list(tree.values()), timeout=10)

    def relay(signum, frame) -> None:
        received.append(signum)
        at.append(time.monotonic())
        if proc is None:  # before the agent started: passed on once it has
            return
        remember()
        if len(received) > 1:
            # one request reaching this process twice (a terminal's Ctrl-C, then accelerate's SIGTERM to every process
            # of the launch): the ranks are saving their step (GracefulInterrupt); a later one kills them
            if at[-1] - at[0] >= GracefulInterrupt.SAME_REQUEST_S:
                kill_tree()
        elif proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

    previous = {}
    for name in RELAYED_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(ValueError):  # not the main thread: signals keep their default behaviour
                previous[sig] = signal.signal(sig, relay)
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent())
        if received:
            relay(received.pop(), None)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received and proc is not None:
            if proc.poll() is None:
                remember()
            kill_tree()
            proc.wait()
    return 128 + received[0] if received else code


def die_with_parent():
    """A ``preexec_fn`` that has the child sent SIGTERM when this process ends, however it ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``); None elsewhere. The C library is loaded here, in the parent, so that the child
    (forked, between fork and exec) only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent ended before the call
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def launcher_option(args: list[str], name: str) -> str | None:
    """Value of ``--name V`` / ``--name=V`` (also with dashes for underscores) in an argument list."""
    names = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, a in enumerate(args):
        key, eq, val = a.partition("=")
        if key in names:
            return val if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


@contextlib.contextmanager
def whole_modules(accelerator):
    """Build models unpartitioned under DeepSpeed ZeRO-3.

    accelerate registers its DeepSpeed config with transformers, whose ``from_pretrained`` then
    builds every model inside ``deepspeed.zero.Init`` (partitioned over ranks). The frozen target
    is never handed to DeepSpeed (docs/method.md §8.13) and must stay whole on each rank; the draft is
    partitioned later by ``accelerator.prepare``."""
    if accelerator is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def configure_deepspeed(accelerator, cfg) -> None:
    """Fill the DeepSpeed config from the run config: micro batch, accumulation, clipping.

    Raises ConfigError when the DeepSpeed JSON pins a different gradient clipping than ``grad_clip``."""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    ds["gradient_accumulation_steps"] = cfg.grad_accum
    ds["train_batch_size"] = cfg.micro_batch_size * cfg.grad_accum * accelerator.num_processes
    clip = ds.get("gradient_clipping", "auto")
    if clip not in ("auto", None) and not math.isclose(float(clip), cfg.grad_clip):
        raise ConfigError(f"config key 'grad_clip' = {cfg.grad_clip} but the DeepSpeed config sets gradient_clipping "
                          f"= {clip}; set it to \"auto\" there (the run config is the one source)")
    ds["gradient_clipping"] = cfg.grad_clip
    ds.setdefault("zero_allow_untested_optimizer", True)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` makes this process print every thread's Python stack to its standard error (file
    descriptor 2, ``sys.__stderr__``, also where ``sys.stderr`` is replaced, as under pytest) and go on
    (``faulthandler``; where a hung rank waits, without ending it). Not on platforms without SIGUSR1, nor in a
    process without a usable fd 2."""
    import faulthandler

    if hasattr(signal, "SIGUSR1"):
        # sys.__stderr__ None or without a file descriptor
        with contextlib.suppress(AttributeError, ValueError, OSError):
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def leave_rank(code: int) -> None:
    """End a rank of a multi-process launch (``WORLD_SIZE`` > 1) with ``os._exit(code)`` after flushing the output,
    skipping the interpreter's teardown: once training is over, every collective is done (the last checkpoint's
    barrier, ``accelerator.end_training`` freed the process group) and every file is closed, but freeing the run's
    objects once blocked a rank for minutes after its peer had exited (CI, a 2-rank CPU run; faulthandler's stack:
    the rank in ``main()`` at ``return train(cfg)``, i.e. as ``train()``'s frame and its locals were freed). So
    ``train()`` calls it itself at its end, while its frame still holds them: called on ``main()``'s result only (as
    the script still does, for the error paths), it came after that freeing. A single-process run exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave_rank(main())
