"""The first two-GPU runs of the trainer (issue 15), in one time-boxed driver that writes one JSON.

    python benchmarks/train/two_gpu.py --output results/train-2gpu-h200.json \\
        --regen-target runs/smollm2/smollm2-hf                   # 2 x H200 (NCCL, NVLink multicast off)
    python benchmarks/train/two_gpu.py --tiny --output /tmp/2gpu.json   # CPU smoke: 2 gloo ranks, tiny shapes

Parts (``--parts a,b,c,d``; each has its own time box, prints its wall clock, and the JSON is rewritten
after each part, so a killed run keeps the finished ones; ``--resume`` skips parts already ``ok``):

a. ``bench_train.py`` at Qwen3-8B shape (random target, 5-layer draft, max length 3072) under ZeRO-2 and
   ZeRO-3 on 1 GPU and on 2 GPUs (the two 1-GPU runs side by side, one per GPU).
   ``scaling_efficiency_zeroK`` = tokens/s per GPU on 2 GPUs / tokens/s on 1 GPU (goal >= 0.9);
   peak memory per GPU.
b. Loss curve: ``train/distill.py`` on a random small Qwen3 target and synthetic copy-task rows, one GPU
   with grad_accum G vs two GPUs with grad_accum G/2 (same global batch G, micro-batch 1, seed; the anchors
   of a row do not depend on the rank layout, train/data.py), ZeRO-3 on both. Tolerance: step 1 runs the
   same weights on the same blocks, so its loss must agree to fp64 summation order (rel. 1e-6). Later steps
   differ only by the order of the bf16 gradient sums (micro-batch accumulation on one GPU vs the
   reduce-scatter over two), i.e. by O(bf16 ulp = 2^-8) relative per step in the update; we accept a
   relative loss difference of 4 ulp = 2^-6 at every step and report the largest one beside the loss drop.
c. ZeRO-3 resume: the two-GPU run of b saves at step k; a second run resumes from it to step n and must
   repeat loss, grad norm and lr of steps k+1..n bitwise and end with bitwise equal draft weights. Then
   a ZeRO-3 job reloads step n, and its logits on a probe batch are compared with those of the saved draft
   loaded on one GPU without DeepSpeed (``draft_logits_identical``: torch.equal).
d. ``data.regenerate`` at T=0 on ``--regen-prompts`` prompts with ``--regen-target`` on 1 GPU and under
   ``accelerate launch --num_processes 2``: rows/s and per-row identical generated token ids. With
   ``--regen-concurrency 1`` each row is decoded alone in both runs, so the batch layout cannot change
   the bf16 rounding; larger values measure throughput but may differ at near-ties.

Without DeepSpeed (the CPU smoke), parts a-c run plain DDP on gloo ranks and say so (``zero_stage``: null).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PARTS = ("a", "b", "c", "d")
STEP1_RTOL = 1e-6  # step-1 loss: same weights, same blocks (module docstring, part b)
LOSS_RTOL = 2.0**-6  # later steps: 4 bf16 ulps
SCALING_GOAL = 0.9
# GPU shape of the small random target of parts b/c (Qwen3 layout, real vocabulary size)
SMALL = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content + eos_token }}"
                  "{% else %}{{ m.content + '\\n' }}{% endif %}{% endfor %}")


# ---------------------------------------------------------------------------------------- checks (pure)


def scaling_efficiency(one: dict, two: dict) -> float | None:
    """tokens/s per GPU of the 2-GPU run / tokens/s of the 1-GPU run (bench_train ``results`` dicts)."""
    if not one or not two or not one.get("tokens_per_s"):
        return None
    return two["tokens_per_s"] / two.get("world_size", 2) / one["tokens_per_s"]


def compare_losses(one: list[dict], two: list[dict], step1_rtol: float = STEP1_RTOL, rtol: float = LOSS_RTOL) -> dict:
    """Loss curves (metrics.jsonl rows with ``step`` and ``loss``) of the 1-GPU and 2-GPU runs.

    ``match``: same steps, step-1 relative difference <= step1_rtol and every step's <= rtol."""
    a = {r["step"]: r["loss"] for r in one if "loss" in r}
    b = {r["step"]: r["loss"] for r in two if "loss" in r}
    steps = sorted(a)
    if not steps or steps != sorted(b):
        return {"match": False, "reason": f"steps differ: {sorted(a)[:5]}... vs {sorted(b)[:5]}...", "steps": len(steps)}
    rel = [abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in steps]
    return {
        "match": rel[0] <= step1_rtol and max(rel) <= rtol,
        "steps": len(steps), "step1_rel_diff": rel[0], "max_rel_diff": max(rel), "mean_rel_diff": sum(rel) / len(rel),
        "step1_rtol": step1_rtol, "rtol": rtol,
        "loss_first": a[steps[0]], "loss_last": a[steps[-1]], "loss_drop": a[steps[0]] - a[steps[-1]],
        "losses_1gpu": [a[s] for s in steps], "losses_2gpu": [b[s] for s in steps],
    }


def compare_resume(straight: list[dict], resumed: list[dict], k: int) -> dict:
    """Steps k+1.. of the uninterrupted and the resumed run: loss, grad_norm and lr bitwise equal."""
    a = {r["step"]: r for r in straight if "loss" in r and r["step"] > k}
    b = {r["step"]: r for r in resumed if "loss" in r and r["step"] > k}
    if not a or sorted(a) != sorted(b):
        return {"exact": False, "reason": f"steps differ: {sorted(a)} vs {sorted(b)}"}
    bad = [s for s in sorted(a) if any(a[s][key] != b[s][key] for key in ("loss", "grad_norm", "lr"))]
    return {"exact": not bad, "steps_compared": len(a), "first_mismatch": bad[0] if bad else None}


def compare_regen(one: list[dict], two: list[dict]) -> dict:
    """Regenerated rows (results.jsonl) of the 1- and 2-process runs: same indices, same token ids."""
    a = {r["index"]: (r["generated_token_ids"], r["finish_reason"]) for r in one}
    b = {r["index"]: (r["generated_token_ids"], r["finish_reason"]) for r in two}
    same = [i for i in a if i in b and a[i] == b[i]]
    return {"identical": bool(a) and set(a) == set(b) and len(same) == len(a), "rows_1gpu": len(a), "rows_2gpu": len(b),
            "identical_rows": len(same), "differing_rows": sorted((set(a) | set(b)) - set(same))[:20]}


def assemble(record: dict) -> dict:
    """Top-level keys of the result file from the parts (None where a part did not run or failed)."""
    parts = record.get("parts", {})
    a, b, c, d = (parts.get(p) or {} for p in PARTS)
    out = {
        "scaling_efficiency_zero2": a.get("scaling_efficiency", {}).get("zero2"),
        "scaling_efficiency_zero3": a.get("scaling_efficiency", {}).get("zero3"),
        "scaling_efficiency_ddp": a.get("scaling_efficiency", {}).get("ddp"),  # CPU smoke only (no DeepSpeed)
        "tokens_per_s_per_gpu": a.get("tokens_per_s_per_gpu"),
        "peak_memory_gib_per_gpu": a.get("peak_memory_gib_per_gpu"),
        "loss_match": b.get("compare", {}).get("match") if b.get("status") == "ok" else None,
        "zero3_resume_exact": c.get("resume", {}).get("exact") if c.get("status") == "ok" else None,
        "draft_logits_identical": c.get("probe", {}).get("logits_identical") if c.get("status") == "ok" else None,
        "regen_identical": d.get("compare", {}).get("identical") if d.get("status") == "ok" else None,
        "regen_rows_per_s": d.get("rows_per_s"),
    }
    eff = out["scaling_efficiency_zero2"]
    out["scaling_goal_met_zero2"] = None if eff is None else eff >= SCALING_GOAL
    return out


# ---------------------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Builds and runs the commands of one part under its time box; logs go to ``work/logs``."""

    def __init__(self, args, deadline: float, commands: list):
        self.args, self.deadline, self.commands = args, deadline, commands

    def cmd(self, target: list[str], nproc: int, accel_config: str | None = None, module: bool = False) -> list[str]:
        py = sys.executable
        if self.args.tiny:  # CPU: gloo ranks straight from torch.distributed.run (accelerate sees MULTI_CPU)
            if nproc == 1:
                return [py, *(["-m"] if module else []), *target]
            return [py, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
                    *(["-m"] if module else []), *target]
        head = [py, "-m", "accelerate.commands.launch", "--num_processes", str(nproc), "--num_machines", "1",
                "--main_process_port", str(free_port()), "--dynamo_backend", "no"]
        if accel_config:
            head += ["--config_file", accel_config]
        elif nproc > 1:
            head += ["--multi_gpu"]
        else:
            head += ["--mixed_precision", "no"]
        return head + (["-m"] if module else []) + target

    def env(self, gpus: str | None) -> dict:
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        if self.args.tiny:
            env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
        elif gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return env

    def start(self, name: str, cmd: list[str], gpus: str | None = None):
        log = Path(self.args.work) / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        shown = (f"CUDA_VISIBLE_DEVICES={gpus} " if gpus is not None and not self.args.tiny else "") + " ".join(cmd)
        self.commands.append(shown)
        print(f"$ {shown}\n  (log: {log})", flush=True)
        fh = open(log, "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=self.env(gpus), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return proc, fh, log, time.perf_counter()

    def wait(self, started) -> dict:
        proc, fh, log, t0 = started
        try:
            rc = proc.wait(timeout=max(1.0, self.deadline - time.time()))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole launch: launcher and its ranks
            rc, timed_out = proc.wait(), True
        fh.close()
        res = {"rc": rc, "timed_out": timed_out, "wall_s": round(time.perf_counter() - t0, 1), "log": str(log)}
        if rc != 0:
            res["log_tail"] = log.read_text(errors="replace")[-3000:]
        return res

    def run(self, name, cmd, gpus=None) -> dict:
        return self.wait(self.start(name, cmd, gpus))


class PartFailed(RuntimeError):
    pass


def ok_or_raise(name: str, res: dict) -> dict:
    if res["timed_out"]:
        raise PartFailed(f"{name}: time box reached after {res['wall_s']} s (log {res['log']})")
    if res["rc"] != 0:
        raise PartFailed(f"{name}: exit code {res['rc']} (log {res['log']}):\n{res.get('log_tail', '')[-1500:]}")
    return res


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


# ---------------------------------------------------------------------------------------- part a


def part_a(args, L: Launcher, deepspeed: bool) -> dict:
    bench = str(REPO / "benchmarks" / "train" / "bench_train.py")
    out_dir = Path(args.work) / "a"
    stages = ("zero2", "zero3") if deepspeed else ("ddp",)
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])

    def cfg(stage, n):
        if stage == "ddp":
            return None
        return str(REPO / "configs" / "accelerate" / (f"{stage}-1gpu.yaml" if n == 1 and stage == "zero2" else f"{stage}.yaml"))

    runs = {}
    singles = [(st, L.start(f"a-{st}-1", L.cmd([bench, *extra, "--output", str(out_dir / f"{st}-1.json")], 1, cfg(st, 1)),
                            gpus=str(i % args.gpus)))
               for i, st in enumerate(stages)] if not args.tiny else []
    for st, started in singles:  # side by side on GPU 0 and GPU 1
        runs[f"{st}-1"] = ok_or_raise(f"a-{st}-1", L.wait(started))
    for st in stages:
        if args.tiny:
            runs[f"{st}-1"] = ok_or_raise(f"a-{st}-1", L.run(f"a-{st}-1", L.cmd(
                [bench, *extra, "--output", str(out_dir / f"{st}-1.json")], 1, cfg(st, 1))))
        runs[f"{st}-2"] = ok_or_raise(f"a-{st}-2", L.run(f"a-{st}-2", L.cmd(
            [bench, *extra, "--output", str(out_dir / f"{st}-2.json")], 2, cfg(st, 2)), gpus="0,1"))
    res = {"runs": runs, "scaling_efficiency": {}, "tokens_per_s_per_gpu": {}, "peak_memory_gib_per_gpu": {},
           "mfu_vs_datasheet": {}, "timed_steps": args.steps, "warmup_steps": args.warmup}
    for st in stages:
        r1 = json.loads((out_dir / f"{st}-1.json").read_text())
        r2 = json.loads((out_dir / f"{st}-2.json").read_text())
        one, two = r1["results"], {**r2["results"], "world_size": r2["config"]["world_size"]}
        key = st if deepspeed else "ddp"
        res["scaling_efficiency"][key] = scaling_efficiency(one, two)
        res["tokens_per_s_per_gpu"][key] = {"1": one["tokens_per_s"], "2": two["tokens_per_s_per_gpu"]}
        res["peak_memory_gib_per_gpu"][key] = {"1": one.get("peak_memory_gib_per_gpu"), "2": two.get("peak_memory_gib_per_gpu")}
        res["mfu_vs_datasheet"][key] = {"1": one["mfu_vs_datasheet"], "2": two["mfu_vs_datasheet"]}
        res[f"zero_stage_{key}"] = r2["config"]["zero_stage"]
    return res


# ---------------------------------------------------------------------------------------- parts b, c


def make_target(folder: Path, tiny: bool) -> Path:
    """A random-weight Qwen3 target folder (config + safetensors, no tokenizer), made once."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**(TINY if tiny else SMALL), initializer_range=0.02))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.float32 if tiny else torch.bfloat16).save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def make_rows(path: Path, n: int, length: int, vocab: int, seed: int = 0) -> Path:
    """Synthetic rows ``{input_ids, loss_mask}``: a random prompt (mask 0) then a repeated random motif
    (mask 1), so that a draft can learn to copy and the loss curve falls."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = rng.randint(length // 8, length // 4)
            motif = [rng.randrange(vocab) for _ in range(rng.randint(4, 16))]
            resp = (motif * (length // len(motif) + 1))[: length - prompt]
            ids = [rng.randrange(vocab) for _ in range(prompt)] + resp
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * len(resp)}) + "\n")
    return path


def train_overrides(args, target: Path, rows: Path, out: Path, grad_accum: int, vocab: int) -> list[str]:
    return [f"target={target}", f"train={rows}", "eval=null", f"output_dir={out}", f"max_steps={args.loss_steps}",
            f"save_every={args.resume_at}", "keep_last=0", "log_every=1", f"grad_accum={grad_accum}",
            "micro_batch_size=1", f"max_length={args.seq_len}", f"anchors_per_seq={args.anchors}", "layers=2",
            f"block_size={8 if args.tiny else 16}", f"mask_token_id={vocab - 1}", "data_workers=0", "seed=0",
            f"save_dtype={'fp32' if args.tiny else 'bf16'}", "warmup_ratio=0.1", "report_to=none"]


def bc_setup(args) -> tuple[Path, Path, int]:
    root = Path(args.work) / "bc"
    root.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.tiny else SMALL
    target = make_target(root / "target", args.tiny)
    rows = root / "rows.jsonl"
    if not rows.is_file():
        make_rows(rows, 64 if args.tiny else 256, args.seq_len, shape["vocab_size"] - 2)
    return target, rows, shape["vocab_size"]


def stage_config(deepspeed: bool, n: int) -> str | None:
    return str(REPO / "configs" / "accelerate" / "zero3.yaml") if deepspeed else None


def part_b(args, L: Launcher, deepspeed: bool) -> dict:
    target, rows, vocab = bc_setup(args)
    distill = str(REPO / "train" / "distill.py")
    G = args.global_batch
    if G % 2:
        raise PartFailed(f"--global-batch {G} must be even (split over 2 GPUs)")
    runs = {}
    for name, n, accum in (("one", 1, G), ("two", 2, G // 2)):
        out = Path(args.work) / "bc" / name
        shutil.rmtree(out, ignore_errors=True)  # the driver owns its work folder: a fresh run each time
        runs[name] = ok_or_raise(f"b-{name}", L.run(f"b-{name}", L.cmd(
            [distill, *train_overrides(args, target, rows, out, accum, vocab)], n, stage_config(deepspeed, n)),
            gpus="0" if n == 1 else "0,1"))
    cmp = compare_losses(read_jsonl(Path(args.work) / "bc" / "one" / "metrics.jsonl"),
                         read_jsonl(Path(args.work) / "bc" / "two" / "metrics.jsonl"))
    return {"runs": runs, "compare": cmp, "global_batch": G, "steps": args.loss_steps,
            "zero_stage": 3 if deepspeed else None, "target_shape": TINY if args.tiny else SMALL}


def safetensors_equal(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def part_c(args, L: Launcher, deepspeed: bool) -> dict:
    target, rows, vocab = bc_setup(args)
    straight = Path(args.work) / "bc" / "two"
    k, n = args.resume_at, args.loss_steps
    if not (straight / f"step-{n}" / "trainer_state.json").is_file():
        raise PartFailed(f"part c needs the finished two-GPU run of part b ({straight}/step-{n}); run --parts b,c")
    resumed = Path(args.work) / "c" / "resumed"
    shutil.rmtree(resumed, ignore_errors=True)
    distill = str(REPO / "train" / "distill.py")
    over = train_overrides(args, target, rows, resumed, args.global_batch // 2, vocab) + [f"resume_from={straight / f'step-{k}'}"]
    runs = {"resume": ok_or_raise("c-resume", L.run("c-resume", L.cmd([distill, *over], 2, stage_config(deepspeed, 2)),
                                                    gpus="0,1"))}
    resume = compare_resume(read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl"), k)
    resume["final_draft_equal"] = safetensors_equal(straight / f"step-{n}" / "draft" / "model.safetensors",
                                                    resumed / f"step-{n}" / "draft" / "model.safetensors")
    resume["exact"] = bool(resume.get("exact")) and resume["final_draft_equal"]
    probe_out = Path(args.work) / "c" / "probe.json"
    probe_out.unlink(missing_ok=True)
    probe_cmd = [str(Path(__file__).resolve()), "--probe", str(straight / f"step-{n}"), "--probe-target", str(target),
                 "--probe-rows", str(rows), "--output", str(probe_out), "--global-batch", str(args.global_batch)] + \
                (["--tiny"] if args.tiny else [])
    runs["probe"] = ok_or_raise("c-probe", L.run("c-probe", L.cmd(probe_cmd, 2, stage_config(deepspeed, 2)), gpus="0,1"))
    return {"runs": runs, "resume_at": k, "steps": n, "resume": resume, "probe": json.loads(probe_out.read_text())}


def probe(args) -> int:
    """Worker (run under the launcher, ZeRO-3 on CUDA): reload checkpoint ``--probe`` into the trainer's
    DeepSpeed engine, compute the draft's logits on a probe batch, and compare them with the saved draft
    loaded on one device without DeepSpeed; also the engine's gathered weights with the saved ones."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from dspine.checkpoint import load_config, load_draft
    from dspine.model import DSpineDraftModel
    from dspine.target import load_target
    from train.config import RunConfig, resolve_device_settings
    from train.data import JsonlRows, make_batch
    from train.distill import configure_deepspeed, whole_modules
    from train.loss import anchor_generator
    from train.step import make_optimizer, make_scheduler

    ckpt = Path(args.probe)
    cuda = torch.cuda.is_available() and not args.tiny
    run = RunConfig(target=args.probe_target, train=args.probe_rows, grad_accum=args.global_batch // 2)
    dev = resolve_device_settings(run, cuda)
    acc = Accelerator(mixed_precision=dev["mixed_precision"], gradient_accumulation_steps=run.grad_accum, cpu=not cuda)
    deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:
        configure_deepspeed(acc, run)
    with whole_modules(acc if deepspeed else None):
        target = load_target(args.probe_target, dtype=dev["target_dtype"], device=acc.device)
        dcfg = load_config(ckpt / "draft")
        target.set_layer_ids(dcfg.target_layer_ids, dcfg.last_layer_features)
        draft = DSpineDraftModel(dcfg).float().train()
    opt = make_optimizer(draft, 6e-4, 0.0, (0.9, 0.999))
    draft, opt = acc.prepare(draft, opt)
    acc.register_for_checkpointing(make_scheduler(opt, 1, 0.04, "cosine"))  # as train/distill.py: same state files
    acc.load_state(str(ckpt / "state"))
    rows = JsonlRows(args.probe_rows)
    b = make_batch([rows.row(0)], [0], max_length=len(rows.row(0)["input_ids"]), block_size=dcfg.block_size,
                   mask_token_id=dcfg.mask_token_id, gamma=7.0, anchors_per_seq=64,
                   generator=anchor_generator(0, -1, 0, 0), pad_to_multiple=dev["pad_to_multiple"],
                   static_anchors=dev["attn"] == "flex").to(acc.device)

    def logits_of(model):
        with torch.no_grad():
            feats = target.features(b.input_ids, b.attention_mask)
            hidden = model(target.embed(b.block_ids), feats, b.anchors, attn=dev["attn"])
            return target.lm_head(hidden).float()

    draft.eval()
    engine_logits = logits_of(draft)  # every rank (ZeRO-3 gathers the partitioned weights in forward)
    state = acc.get_state_dict(draft)  # collective
    if acc.is_main_process:
        from safetensors.torch import load_file

        saved = load_file(str(ckpt / "draft" / "model.safetensors"))
        weights_equal = saved.keys() == state.keys() and all(
            torch.equal(saved[k].to(state[k].device), state[k].to(saved[k].dtype)) for k in saved)
        save_dtype = next(iter(saved.values())).dtype
        plain = load_draft(ckpt / "draft", dtype=save_dtype).to(acc.device).eval()
        plain_logits = logits_of(plain)
        diff = (engine_logits - plain_logits).abs().max().item()
        res = {"logits_identical": bool(torch.equal(engine_logits, plain_logits)), "max_abs_diff": diff,
               "weights_equal_saved": bool(weights_equal), "probe_rows": int(engine_logits.shape[1]),
               "engine": str(acc.distributed_type), "zero_stage": acc.state.deepspeed_plugin.zero_stage if deepspeed else None,
               "saved_dtype": str(save_dtype), "world_size": acc.num_processes}
        Path(args.output).write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res))
    acc.wait_for_everyone()
    acc.end_training()
    return 0


# ---------------------------------------------------------------------------------------- part d


def make_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` normalized single-turn rows (data.prepare format), varied and deterministic."""
    rng = random.Random(seed)
    topics = ["the sea", "prime numbers", "a small robot", "autumn", "bread", "the moon", "trains", "a lost key"]
    forms = ["What is {a} + {b}? Explain step by step.", "Write a short poem about {t}.",
             "Give {k} facts about {t}.", "Tell a story about {t} in {k} sentences.",
             "If a box holds {a} apples and {b} are eaten, how many are left?"]
    with open(path, "w") as f:
        for i in range(n):
            text = rng.choice(forms).format(a=rng.randint(10, 999), b=rng.randint(1, 9), k=rng.randint(2, 6),
                                            t=rng.choice(topics))
            f.write(json.dumps({"id": f"twogpu:{i}", "conversations": [{"role": "user", "content": text}]}) + "\n")
    return path


def part_d(args, L: Launcher) -> dict:
    root = Path(args.work) / "d"
    root.mkdir(parents=True, exist_ok=True)
    target = args.regen_target
    if not target:
        shared = Path(os.environ.get("DSPINE_SHARED", REPO.parent / "shared"))
        if args.tiny and (shared / "models" / "stories260K" / "hf").is_dir():
            target = str(shared / "models" / "stories260K" / "hf")
        else:
            raise PartFailed("part d needs --regen-target (HF folder or .gguf of the SmolLM2 target)")
    if target.endswith(".gguf"):  # convert once: both runs then load the HF folder in seconds
        hf = root / "target-hf"
        if not (hf / "config.json").is_file():
            ok_or_raise("d-convert", L.run("d-convert", [sys.executable, "-m", "dspine.convert", "--target", target,
                                                         "--out", str(hf), "--dtype", "bf16"]))
        target = str(hf)
    prompts = Path(args.regen_input) if args.regen_input else make_prompts(root / "prompts.jsonl", args.regen_prompts)
    extra = []
    if args.tiny:
        tpl = root / "plain.jinja"
        tpl.write_text(PLAIN_TEMPLATE)
        extra = ["--chat-template", str(tpl), "--max-context", "512"]
    runs, summaries = {}, {}
    for name, n in (("one", 1), ("two", 2)):
        out = root / name
        shutil.rmtree(out, ignore_errors=True)
        cmd = ["data.regenerate", "--target", target, "--input", str(prompts), "--output", str(out),
               "--max-new-tokens", str(args.regen_new_tokens), "--temperature", "0", "--max-turns", "1",
               "--limit", str(args.regen_prompts), "--batch-size", str(args.regen_batch), "--backend", args.regen_backend,
               *(["--concurrency", str(args.regen_concurrency)] if args.regen_backend != "hf" else []), *extra]
        runs[name] = ok_or_raise(f"d-{name}", L.run(f"d-{name}", L.cmd(cmd, n, None, module=True),
                                                    gpus="0" if n == 1 else "0,1"))
        summaries[name] = json.loads((out / "summary.json").read_text())
    cmp = compare_regen(read_jsonl(root / "one" / "results.jsonl"), read_jsonl(root / "two" / "results.jsonl"))
    rps = {name: s["results"] / s["wall_s"] if s.get("wall_s") else None for name, s in summaries.items()}
    return {"runs": runs, "compare": cmp, "target": target, "prompts": args.regen_prompts,
            "max_new_tokens": args.regen_new_tokens, "concurrency": args.regen_concurrency, "backend": args.regen_backend,
            "rows_per_s": {"1": rps["one"], "2": rps["two"]},
            "regen_scaling": rps["two"] / rps["one"] if rps["one"] and rps["two"] else None,
            "generated_tokens_per_s": {"1": summaries["one"].get("generated_tokens_per_s"),
                                       "2": summaries["two"].get("generated_tokens_per_s")},
            "summaries": summaries}


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True, help="result JSON (rewritten after every part)")
    ap.add_argument("--parts", default="a,b,c,d")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 2 gloo processes, tiny shapes, no DeepSpeed")
    ap.add_argument("--resume", action="store_true", help="keep parts already 'ok' in --output")
    ap.add_argument("--work", default=None, help="scratch folder (default runs/two_gpu, or runs/two_gpu-tiny)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="part a: timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="part a: untimed steps per run")
    ap.add_argument("--loss-steps", type=int, default=30, help="parts b/c: optimizer steps n")
    ap.add_argument("--resume-at", type=int, default=15, help="part c: checkpoint step k")
    ap.add_argument("--global-batch", type=int, default=4, help="parts b/c: sequences per step (even)")
    ap.add_argument("--seq-len", type=int, default=None, help="parts b/c: row length (1024; tiny 48)")
    ap.add_argument("--anchors", type=int, default=None, help="parts b/c: anchors per sequence (256; tiny 8)")
    ap.add_argument("--regen-target", default=None, help="part d: SmolLM2 HF folder or .gguf")
    ap.add_argument("--regen-input", default=None, help="part d: normalized prompts JSONL (default: synthetic)")
    ap.add_argument("--regen-prompts", type=int, default=256)
    ap.add_argument("--regen-new-tokens", type=int, default=128)
    ap.add_argument("--regen-concurrency", type=int, default=1)
    ap.add_argument("--regen-batch", type=int, default=64, help="part d: rows per resumable write")
    ap.add_argument("--regen-backend", default="auto", choices=["auto", "hf", "engine"])
    ap.add_argument("--time-box", default="a=330,b=170,c=170,d=240", help="seconds per part")
    # worker mode of part c (run under the launcher)
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-target", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-rows", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        return probe(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part(s) {bad}; choose from {','.join(PARTS)}")
    try:
        boxes = {k: float(v) for k, v in (x.split("=") for x in args.time_box.split(","))}
    except ValueError:
        ap.error(f"--time-box {args.time_box!r}: expected part=seconds,...")
    if args.tiny:
        boxes = {p: max(boxes.get(p, 0), 600.0) for p in PARTS}
        args.regen_prompts, args.regen_new_tokens = min(args.regen_prompts, 16), min(args.regen_new_tokens, 8)
        args.regen_backend, args.regen_batch = "hf", min(args.regen_batch, 4)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.loss_steps, args.resume_at = min(args.loss_steps, 6), min(args.resume_at, 3)
    args.seq_len = args.seq_len or (48 if args.tiny else 1024)
    args.anchors = args.anchors or (8 if args.tiny else 256)
    args.work = args.work or str(REPO / "runs" / ("two_gpu-tiny" if args.tiny else "two_gpu"))
    if not 0 < args.resume_at < args.loss_steps:
        ap.error(f"--resume-at {args.resume_at} must be in 1..--loss-steps-1 ({args.loss_steps - 1})")

    import torch

    from dspine.io import atomic_write_json
    from dspine.provenance import provenance

    if not args.tiny and torch.cuda.device_count() < args.gpus:
        print(f"error: {args.gpus} GPUs needed, {torch.cuda.device_count()} visible (use --tiny on a CPU)", file=sys.stderr)
        return 2
    deepspeed = has_deepspeed() and not args.tiny
    if not args.tiny and not deepspeed and any(p in parts for p in "abc"):
        print("error: parts a-c need DeepSpeed on the GPU (pip install deepspeed); --parts d runs without it",
              file=sys.stderr)
        return 2
    out = Path(args.output)
    record = json.loads(out.read_text()) if args.resume and out.is_file() else {}
    record.update(provenance(argv if argv is None else [sys.argv[0], *argv]))
    record.setdefault("parts", {})
    record["config"] = {k: v for k, v in vars(args).items() if not k.startswith("probe")}
    record["config"].update(deepspeed=deepspeed, nccl_nvls_enable=0)
    if deepspeed:
        import deepspeed as ds

        record["config"]["deepspeed_version"] = ds.__version__
    out.parent.mkdir(parents=True, exist_ok=True)
    funcs = {"a": lambda L: part_a(args, L, deepspeed), "b": lambda L: part_b(args, L, deepspeed),
             "c": lambda L: part_c(args, L, deepspeed), "d": lambda L: part_d(args, L)}
    failed = False
    for p in parts:
        if args.resume and record["parts"].get(p, {}).get("status") == "ok":
            print(f"== part {p}: already ok in {out}, kept", flush=True)
            continue
        t0 = time.perf_counter()
        commands: list[str] = []
        L = Launcher(args, time.time() + boxes.get(p, 300.0), commands)
        print(f"== part {p} (time box {boxes.get(p, 300.0):.0f} s)", flush=True)
        try:
            res = {"status": "ok", **funcs[p](L)}
        except PartFailed as e:
            res, failed = {"status": "failed", "error": str(e)}, True
        except Exception as e:  # a driver bug must not lose the parts already measured
            res, failed = {"status": "failed", "error": f"{type(e).__name__}: {e}"}, True
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        res["commands"] = commands
        record["parts"][p] = res
        record.update(assemble(record))
        atomic_write_json(out, record)
        print(f"== part {p}: {res['status']} in {res['wall_s']} s" + (f": {res['error'][:2000]}" if "error" in res else ""),
              flush=True)
    summary = {k: record.get(k) for k in ("scaling_efficiency_zero2", "scaling_efficiency_zero3", "loss_match",
                                          "zero3_resume_exact", "draft_logits_identical", "regen_identical")}
    print(json.dumps(summary, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
