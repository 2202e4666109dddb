"""End to end on the CPU: `accelerate launch --num_processes 2 --cpu train/distill.py` with stories260K.

A shortened configs/stories260k-cpu.yaml run (loss falls, disjoint ranks, eval metrics, reloadable
draft, W&B offline), and exact resume: 40 steps straight == 20 steps + SIGKILL + resume ==
20 steps (stop_after_steps) + resume, compared bitwise through metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from data.sample_target import main as sample_main
from tests.conftest import REPO

CONFIG = REPO / "configs" / "stories260k-cpu.yaml"


def launch_cmd(*overrides: str) -> list[str]:
    """No --main_process_port: the ranks meet at a port the OS picks as the rendezvous store binds it
    (train/distill.py's relaunch_cpu_ranks), so launches of parallel pytest workers cannot meet at one port."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
            str(REPO / "train" / "distill.py"), "--config", str(CONFIG), *overrides]


# two CPU ranks on a 2-core CI machine that another pytest worker shares: one torch thread per rank (the
# stories config's advice for a shared machine); with torch's default each rank spun two threads and a 40-step
# run once passed its 300 s timeout
LAUNCH_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def launched(mark: str) -> list:
    """Every live process of the launch whose environment carries ``DSPINE_TEST_LAUNCH=mark`` (launcher, the
    relaunching distill.py, the torch.distributed agent, the ranks; found by environment, not as children: a rank
    whose parent died is re-parented, and the ranks run in sessions of their own)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("DSPINE_TEST_LAUNCH") == mark:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def signal_all(procs, sig) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def run(*overrides: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    """The launch, checked for exit code 0. Output goes to files (no wait on a pipe's end). On a timeout the ranks
    (the launch's processes without children) get SIGABRT, so that faulthandler (PYTHONFAULTHANDLER) prints their
    Python stacks, which the agent and the launcher pass on as they shut down; whatever is left after 30 s is
    killed, and the failure shows the output's tail with those stacks: where each rank waited."""
    import tempfile
    import uuid

    cmd, mark = launch_cmd(*overrides), uuid.uuid4().hex
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=REPO,
                                env={**LAUNCH_ENV, "PYTHONFAULTHANDLER": "1", "DSPINE_TEST_LAUNCH": mark, **(env or {})})
        try:
            proc.wait(timeout=timeout)
        except BaseException as e:  # the timeout, or Ctrl-C / pytest-timeout: leave no process of the launch behind
            if isinstance(e, subprocess.TimeoutExpired):
                signal_all([p for p in launched(mark) if not p.children()], signal.SIGABRT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            signal_all(launched(mark), signal.SIGKILL)
            proc.wait(timeout=30)
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            out.seek(0), err.seek(0)
            pytest.fail(f"no end after {timeout} s: {shlex.join(cmd)}\n--- stdout (tail)\n{out.read()[-3000:]}\n"
                        f"--- stderr (tail, with the ranks' stacks at the timeout)\n{err.read()[-20000:]}")
        out.seek(0), err.seek(0)
        r = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-12000:]
    return r


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def data(tmp_path_factory, stories_dir):
    root = tmp_path_factory.mktemp("stories_data")
    for name, num, seed in (("train", 192, 0), ("eval", 16, 1)):
        assert sample_main(["--target", str(stories_dir), "--num", str(num), "--max-new-tokens", "48", "--seed",
                            str(seed), "--batch-size", "192", "--out", str(root / f"{name}.jsonl")]) == 0
    return root, [f"target={stories_dir}", f"train={root / 'train.jsonl'}", f"eval={root / 'eval.jsonl'}"]


def test_stories_run_two_ranks(data, tmp_path):
    _, paths = data
    out = tmp_path / "run"
    run(*paths, f"output_dir={out}", "max_steps=60", "save_every=30", "eval_every=30", "keep_last=1",
        "log_every=5", "log_samples=true", "eval_prompts=2", "eval_max_new_tokens=24", "report_to=wandb",
        "wandb_run_name=ci", "wandb_tags=[cpu,test]", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    rows = jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in train] == list(range(5, 61, 5)) and [r["step"] for r in evals] == [30, 60]
    assert all(k in train[0] for k in ("lr", "grad_norm", "tokens_per_s", "loss"))
    assert train[-1]["loss"] < 0.8 * train[1]["loss"]  # step 60 vs step 10 (step 5 is the init spike)
    assert evals[1]["eval/loss"] < evals[0]["eval/loss"]
    for e in evals:
        acc = e["eval/acc_at_pos"]
        assert len(acc) == 7 and all(a > 0 for a in acc)  # every slot 1..bs-1 defined and non-zero
        assert e["eval/tau_sim"] == pytest.approx(1 + sum(e["eval/accept_at_pos"]))
        assert e["eval/accept_at_pos"][0] == pytest.approx(acc[0])
        assert 1.0 <= e["eval/tau_real"] <= 8 and len(e["eval/real_accept_at_pos"]) == 7
    # the two ranks read disjoint rows, each row at most once per epoch (192 rows / 16 per step)
    s0, s1 = jsonl(out / "samples-rank0.jsonl"), jsonl(out / "samples-rank1.jsonl")
    assert len(s0) == len(s1) == 60
    for a, b in zip(s0, s1):
        assert len(a["rows"]) == len(b["rows"]) == 8 and not set(a["rows"]) & set(b["rows"])
    for epoch in range(5):
        seen = [i for s in s0[epoch * 12:(epoch + 1) * 12] + s1[epoch * 12:(epoch + 1) * 12] for i in s["rows"]]
        assert len(seen) == len(set(seen))
    # checkpoint: rotation, latest, config, loadable draft with identical logits to the trained weights
    assert (out / "latest").read_text().strip() == "step-60" and not (out / "step-30").exists()
    ckpt = out / "step-60"
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 60
    saved_cfg = json.loads((ckpt / "config.json").read_text())
    assert saved_cfg["max_steps"] == 60 and saved_cfg["world_size"] == 2 and saved_cfg["layers"] == 2
    from safetensors.torch import load_file

    from dspine.checkpoint import load_draft
    from dspine.model import DSpineDraftModel

    draft = load_draft(ckpt / "draft")
    names = set(draft.state_dict())
    assert "fc.weight" in names and "layers.0.adjacent.gate" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    trained = DSpineDraftModel(draft.config)
    trained.load_state_dict(load_file(str(ckpt / "state" / "model.safetensors")))
    g = torch.Generator().manual_seed(0)
    H = draft.config.hidden_size
    feats, emb = torch.randn(1, 30, 2 * H, generator=g), torch.randn(1, 24, H, generator=g)
    anchors = torch.tensor([[3, 10, 20]])
    with torch.no_grad():
        assert torch.equal(draft.forward_train(emb, feats, anchors), trained.eval().forward_train(emb, feats, anchors))
    assert draft.layers[0].adjacent.gate.abs().sum() > 0  # the injection was trained
    assert list((out / "wandb").glob("offline-run-*"))


COMMON = ("max_steps=40", "save_every=20", "eval=null", "log_every=1", "log_samples=true", "anchors_per_seq=16",
          "max_length=40", "keep_last=0")


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run(*data[1], *COMMON, f"output_dir={out}")
    return out


def assert_same_run(a, b):
    ra, rb = jsonl(a / "metrics.jsonl"), jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, 41))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]  # bitwise
    assert [r["lr"] for r in ra] == [r["lr"] for r in rb]
    assert [r["grad_norm"] for r in ra] == [r["grad_norm"] for r in rb]
    for rank in (0, 1):
        sa, sb = jsonl(a / f"samples-rank{rank}.jsonl"), jsonl(b / f"samples-rank{rank}.jsonl")
        assert sa == sb  # same rows at every step: nothing seen twice or skipped by the resume
    for d in (a, b):
        state = json.loads((d / "step-40" / "trainer_state.json").read_text())
        assert (state["step"], state["epoch"], state["index"]) == (40, 3, 64)  # 12 steps of 16 rows per epoch


def test_resume_after_sigkill_is_exact(data, straight, tmp_path):
    import psutil

    out = tmp_path / "killed"
    proc = subprocess.Popen(launch_cmd(*data[1], *COMMON, f"output_dir={out}"), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=LAUNCH_ENV)
    deadline = time.time() + 240
    latest = out / "latest"
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == "step-20":
            break
        time.sleep(0.02)
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:  # the launcher and every rank it started (workers run in their own sessions)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    assert latest.read_text().strip() == "step-20" and not (out / "step-40").exists()
    assert len(jsonl(out / "metrics.jsonl")) >= 20
    run(*data[1], *COMMON, f"output_dir={out}")  # resume_from: auto
    assert_same_run(straight, out)


def test_resume_after_stop_is_exact(data, straight, tmp_path):
    """Also the prefetching path: batches built by 2 DataLoader worker processes equal the in-loop ones."""
    out = tmp_path / "stopped"
    run(*data[1], *COMMON, f"output_dir={out}", "stop_after_steps=20", "data_workers=2")
    assert (out / "latest").read_text().strip() == "step-20" and len(jsonl(out / "metrics.jsonl")) == 20
    run(*data[1], *COMMON, f"output_dir={out}", f"resume_from={out / 'step-20'}", "data_workers=2")
    assert_same_run(straight, out)


def test_ctrl_c_saves_the_step_and_resumes(data, tmp_path):
    """Ctrl-C (SIGINT) ends the run after the step in progress with a checkpoint of that step and exit code
    130; `resume_from=auto` then continues from it, every step logged once (was: a traceback, no save)."""
    out = tmp_path / "ctrl-c"
    cmd = [sys.executable, str(REPO / "train" / "distill.py"), "--config", str(CONFIG), *data[1], *COMMON,
           f"output_dir={out}", "save_every=0", "max_steps=16"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").is_file() and len(jsonl(out / "metrics.jsonl")) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    k = len(jsonl(out / "metrics.jsonl"))
    assert 3 <= k < 16 and (out / "latest").read_text().strip() == f"step-{k}", err[-3000:]
    assert json.loads((out / f"step-{k}" / "trainer_state.json").read_text())["step"] == k
    assert f"stopped after step {k}" in err and "Traceback" not in err
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in jsonl(out / "metrics.jsonl")] == list(range(1, 17))


@pytest.mark.parametrize("launcher, file_cfg, master_port, meet", [  # master_port: what accelerate exports
    (["--num_processes", "2", "--cpu"], None, "29500", ["--standalone"]),
    (["--cpu", "--num-processes=2", "--main-process-port=29533"], None, "29533",
     ["--master_addr=127.0.0.1", "--master_port=29533"]),
    (["--cpu", "--config_file", "{cfg}"], {"num_processes": 3, "main_process_port": 29544}, "29544",
     ["--master_addr=127.0.0.1", "--master_port=29544"]),
    (["--cpu", "--config_file", "{cfg}"], {"num_processes": 2}, "29500", ["--standalone"]),
    (["--cpu", "--num_processes", "1"], None, "29500", None),
    (["--cpu", "--num_processes", "2", "--main_process_port", "0"], None, "0", ["--standalone"]),
])
def test_cpu_ranks_meet_where_the_launcher_says(monkeypatch, tmp_path, launcher, file_cfg, master_port, meet):
    """relaunch_cpu_ranks: the torch.distributed.run command for `accelerate launch --cpu --num_processes N`: the
    ranks meet at the launcher's --main_process_port (command line or --config_file) when one is given, else
    at a port the OS picks (--standalone), not at the 29500 accelerate puts in MASTER_PORT by default; N <= 1
    runs in this process (None)."""
    import pathlib

    import yaml

    from train import distill

    cfg = tmp_path / "accelerate.yaml"
    if file_cfg is not None:
        cfg.write_text(yaml.safe_dump(file_cfg))
    cmdline = "\0".join(["accelerate", "launch", *[a.replace("{cfg}", str(cfg)) for a in launcher], "train/distill.py"])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", master_port)
    monkeypatch.setattr(os, "getppid", lambda: 987654)
    real = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes",
                        lambda p: cmdline.encode() if str(p) == "/proc/987654/cmdline" else real(p))
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    rc = distill.relaunch_cpu_ranks(["--config", "x.yaml"])
    if meet is None:
        assert rc is None and calls == []
        return
    n = (file_cfg or {}).get("num_processes", 2)
    assert rc == 0 and calls == [[sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", *meet,
                                  str(REPO / "train" / "distill.py"), "--config", "x.yaml"]]


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_rank_leaves_with_its_code_and_its_output(world):
    """leave_rank: a rank of a multi-process launch (WORLD_SIZE > 1) ends with os._exit after flushing what it
    printed (its teardown is skipped); a single process exits through SystemExit. Same code and output either way."""
    code = ("import sys; from train.distill import leave_rank; print('out', end=''); print('err', end='', "
            "file=sys.stderr); leave_rank(3)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WORLD_SIZE": world})
    assert (r.returncode, r.stdout, r.stderr[-3:]) == (3, "out", "err")
