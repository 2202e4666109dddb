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
import yaml

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


def ranks_of(mark: str) -> list:
    """The ranks of the launch ``mark``: its processes whose parent is the torch.distributed.run agent (not the
    DataLoader workers a rank forks, which share its command line and environment)."""
    import psutil

    found = []
    for p in launched(mark):
        try:
            parent = p.parent()
            if parent is not None and "torch.distributed.run" in parent.cmdline():  # an argv element (-m ...)
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


def start(*overrides: str, env=None, cmd=None, **popen) -> tuple[subprocess.Popen, str]:
    """The launch (``cmd``, default ``launch_cmd(*overrides)``), started and not waited for, with its mark
    (``launched(mark)``: its processes); ``env`` adds to ``LAUNCH_ENV`` (a None value unsets the variable); output
    discarded unless ``popen`` says otherwise."""
    import uuid

    mark = uuid.uuid4().hex
    popen = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True, **popen}
    env = {k: v for k, v in {**LAUNCH_ENV, "DSPINE_TEST_LAUNCH": mark, **(env or {})}.items() if v is not None}
    proc = subprocess.Popen(cmd or launch_cmd(*overrides), cwd=REPO, env=env, **popen)
    return proc, mark


def run(*overrides: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    """The launch, checked for exit code 0. Output goes to files (no wait on a pipe's end). On a timeout each rank
    (:func:`ranks_of`) gets SIGUSR1 in turn, so that it prints its Python stacks and goes on
    (train/distill.py dump_stacks_on_sigusr1; one at a time, the dumps not interleaved, and no rank ended before its
    turn by the agent reacting to another's end), then every process of the launch is killed, and the failure shows
    those stacks first, then the output's tail: where each rank waited."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc, mark = start(*overrides, env=env, stdout=out, stderr=err, text=True, start_new_session=False)
        cmd = proc.args
        try:
            proc.wait(timeout=timeout)
        except BaseException as e:  # the timeout, or Ctrl-C / pytest-timeout: leave no process of the launch behind
            if isinstance(e, subprocess.TimeoutExpired):
                for rank in ranks_of(mark):
                    signal_all([rank], signal.SIGUSR1)
                    time.sleep(1)
            signal_all(launched(mark), signal.SIGKILL)
            proc.wait(timeout=30)
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            out.seek(0), err.seek(0)
            stderr = err.read()
            # no traceback of this helper (pytrace=False) and the ranks' stacks first: a CI log cut to its first and
            # last lines still shows where each rank waited
            pytest.fail(f"no end after {timeout} s: {shlex.join(cmd)}\n--- the ranks' Python stacks at the timeout\n"
                        f"{rank_stacks(stderr)[-12000:]}\n--- stdout (tail)\n{out.read()[-1000:]}\n"
                        f"--- stderr (tail)\n{stderr[-6000:]}", pytrace=False)
        out.seek(0), err.seek(0)
        r = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-12000:]
    return r


def rank_stacks(stderr: str) -> str:
    """The lines of faulthandler's dumps in a launch's stderr, without the output around them: its headers ("Fatal
    Python error", "Thread 0x..." / "Current thread ...", "Garbage-collecting", "<no Python frame>"; found anywhere in
    a line, behind a progress bar's text or a "[rank1]:" prefix, and kept from there) and its frames ('  File "...",
    line N in f': no comma before "in", unlike a Python traceback's frames, which are left out)."""
    import re

    header = re.compile(r"Fatal Python error|Thread 0x|Current thread|Garbage-collecting|<no Python frame>")
    frame = re.compile(r'^(\[[^\]]*\]:\s?)?\s+File ".*", line \d+ in ')
    keep = []
    for line in stderr.splitlines():
        m = header.search(line)
        if m:
            keep.append(line[m.start():])
        elif frame.match(line):
            keep.append(line)
    return "\n".join(keep) or "(none in stderr)"


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


def test_torchrun_on_a_cpu_machine_trains_two_ranks_and_leaves_no_process(data, tmp_path):
    """A bare `python -m torch.distributed.run --nproc_per_node 2 train/distill.py` on a machine without GPUs (the
    command the trainer's own messages suggest): the ranks meet through gloo as one run of world size 2 (was: accelerate
    set up one process per rank, and both trained alone into one output_dir), read disjoint rows, and with 2 data
    workers each no process of the launch outlives it (was: the ranks left by os._exit with their DataLoader workers
    alive, found by PyTorch's watchdog seconds later)."""
    import tempfile

    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(REPO / "train" / "distill.py"), "--config", str(CONFIG), *data[1], f"output_dir={out}", "max_steps=4",
           "save_every=0", "eval=null", "log_every=1", "log_samples=true", "max_length=40", "data_workers=2"]
    with tempfile.TemporaryFile("w+") as log:
        proc, mark = start(cmd=cmd, env={"ACCELERATE_USE_CPU": None}, stdout=log, stderr=log, text=True)
        try:
            proc.wait(timeout=300)
            left = [p.pid for p in launched(mark)]
        finally:
            signal_all(launched(mark), signal.SIGKILL)
        log.seek(0)
        text = log.read()
    assert proc.returncode == 0, text[-4000:]
    assert "2 rank(s), DistributedType.MULTI_CPU" in text, text[-4000:]
    assert left == [], f"processes of the launch still alive after it ended: {left}"
    assert json.loads((out / "step-4" / "config.json").read_text())["world_size"] == 2
    s0, s1 = jsonl(out / "samples-rank0.jsonl"), jsonl(out / "samples-rank1.jsonl")
    assert len(s0) == len(s1) == 4 and all(not set(a["rows"]) & set(b["rows"]) for a, b in zip(s0, s1))


def test_resume_after_sigkill_is_exact(data, straight, tmp_path):
    out = tmp_path / "killed"
    proc, mark = start(*data[1], *COMMON, f"output_dir={out}")
    deadline = time.time() + 240
    latest = out / "latest"
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == "step-20":
            break
        time.sleep(0.02)
    signal_all(launched(mark), signal.SIGKILL)  # the launcher and every rank it started
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


# Runs train/distill.py's main() once per case in one child process (one torch start); a case
# [argv, k, strip] sends this process a real SIGINT during its k-th step (the trainer's GracefulInterrupt then
# stops after that step with a checkpoint), and first removes the keys "window" and "eval_pending" from the
# trainer_state.json at path strip (a checkpoint written before they existed).
_SIGINT_CASES = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from train import distill

step, evaluate, codes, calls = distill.train_step, distill.evaluate, [], [0]


def train_step(*a, **k):
    calls[0] += 1
    if calls[0] == at:
        os.kill(os.getpid(), signal.SIGINT)
    return step(*a, **k)


def evaluate_(*a, **k):
    if at == -1:  # a Ctrl-C during the run's first eval (a resume's pending one), before GracefulInterrupt is set up:
        raise KeyboardInterrupt  # what Python's default SIGINT handler raises (a real signal: once missed under load)
    return evaluate(*a, **k)


distill.train_step, distill.evaluate = train_step, evaluate_
for argv, at, strip in json.load(open(sys.argv[2])):
    if strip:
        state = json.load(open(strip))
        json.dump({k: v for k, v in state.items() if k not in ("window", "eval_pending")}, open(strip, "w"))
    calls[0] = 0
    codes.append(distill.main(argv))
print(json.dumps(codes))
"""


def test_ctrl_c_off_a_log_boundary_and_at_eval_steps_resumes_to_the_same_metrics(stories_dir, tmp_path):
    """SIGINT during step 5 (an eval step between the log rows of steps 3 and 6), resume, SIGINT during the last
    step 8 (its eval due), resume: metrics.jsonl holds the uninterrupted run's rows, the same steps and values
    (timings aside), eval rows included (was: a partial row at step 5, the row of step 6 averaging step 6 only, and
    the evals of steps 5 and 8 never run). A Ctrl-C during the first resume's pending eval exits 130 with a line,
    not a traceback, and the next resume runs that eval again. A third resume of step-8 runs its pending eval again without a second
    row; a checkpoint without the logging window and pending eval (an older one) still resumes. A planned stop
    (stop_after_steps=4, between log rows) and its resume write the same rows too (was: a partial row at step 4)."""
    g = torch.Generator().manual_seed(0)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1, *torch.randint(3, 512, (39,), generator=g).tolist()],
                                        "loss_mask": [0] * 6 + [1] * 34}) + "\n" for _ in range(24)))
    common = ["--config", str(CONFIG), f"target={stories_dir}", f"train={rows}", f"eval={rows}", "max_steps=8",
              "log_every=3", "eval_every=5", "eval_max_rows=4", "eval_prompts=2", "eval_max_new_tokens=8",
              "micro_batch_size=4", "anchors_per_seq=8", "max_length=40", "save_every=0", "keep_last=0"]
    a, b, c, d = (common + [f"output_dir={tmp_path / x}"] for x in "abcd")
    cases = [[a, 0, None], [b, 5, None], [b, -1, None], [b, 3, None], [b, 0, None], [b, 0, None],
             [c, 5, None], [c, 0, str(tmp_path / "c" / "step-5" / "trainer_state.json")],
             [d + ["stop_after_steps=4"], 0, None], [d, 0, None]]  # a planned stop between log rows
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = subprocess.run([sys.executable, "-c", _SIGINT_CASES, str(REPO), str(tmp_path / "cases.json")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1]) == [0, 130, 130, 130, 0, 0, 130, 0, 0, 0], r.stderr[-4000:]
    assert r.stderr.count("keeps its last checkpoint, and resume_from=auto continues") == 1 and "Traceback" not in r.stderr
    untimed = lambda out: [{k: v for k, v in row.items() if not k.endswith(("_s", "seconds"))}
                           for row in jsonl(tmp_path / out / "metrics.jsonl")]
    straight = untimed("a")
    assert [(x["step"], "eval/loss" in x) for x in straight] == [(3, False), (5, True), (6, False), (8, False),
                                                                 (8, True)]
    assert untimed("b") == straight and untimed("d") == straight
    assert [x["step"] for x in untimed("c")] == [3, 6, 8, 8]  # the old state: no pending eval, an empty window


# Runs train/distill.py as the script (runpy, "__main__") or imports it (any other argument), with a real SIGINT sent
# while torch imports its first submodule: a Ctrl-C during the seconds of start-up imports.
_CTRL_C_IN_IMPORTS = r"""
import os, runpy, signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Python, whatever this process inherited


class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torch."):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, CtrlC())
script, mode = sys.argv[1], sys.argv[2]
if mode == "script":
    sys.argv = [script, "--config", "no-such.yaml"]  # not read: the run stops before main()
    runpy.run_path(script, run_name="__main__")
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(script)))
    import train.distill
"""


def test_ctrl_c_during_the_start_up_imports_is_one_line_and_130():
    """A Ctrl-C while train/distill.py imports torch and the rest (seconds) ends it with one line, exit 130, like
    the trainer's other Ctrl-C paths (was: a traceback through torch's __init__); a module that imports it still
    gets the KeyboardInterrupt."""
    script = str(REPO / "train" / "distill.py")
    r = subprocess.run([sys.executable, "-c", _CTRL_C_IN_IMPORTS, script, "script"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted: while starting up, nothing was written"), r.stderr
    r = subprocess.run([sys.executable, "-c", _CTRL_C_IN_IMPORTS, script, "import"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGINT and r.stderr.rstrip().endswith("KeyboardInterrupt"), r.stderr[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL, "ctrl-c"],
                         ids=["SIGTERM", "SIGINT", "SIGKILL", "ctrl-c"])
def test_a_signal_to_the_relaunching_process_ends_every_rank(data, tmp_path, sig):
    """SIGTERM or SIGINT sent to the distill.py process that relaunched the CPU ranks (not to accelerate or a rank)
    reaches the ranks through torch.distributed.run: every process of the launch is gone within a minute (was: the
    agent and both ranks trained on unattended), and the ranks save the step they were at (GracefulInterrupt), as
    a Ctrl-C of one process does. A SIGKILL, which cannot be passed on, ends them too: the agent gets SIGTERM when
    its parent dies (Linux PR_SET_PDEATHSIG). "ctrl-c": SIGINT to the launch's process group, as a terminal sends
    it: accelerate then sends SIGTERM to every process of the launch, which the ranks take as the same request
    (it once made them abort without a checkpoint)."""
    import tempfile

    out = tmp_path / "signalled"
    with tempfile.TemporaryFile("w+") as err:
        proc, mark = start(*data[1], *COMMON, f"output_dir={out}", "max_steps=5000", "save_every=0", stderr=err,
                           text=True)
        try:
            deadline = time.time() + 240
            while time.time() < deadline and proc.poll() is None:
                if (out / "metrics.jsonl").is_file() and len(jsonl(out / "metrics.jsonl")) >= 2:
                    break
                time.sleep(0.05)
            procs = launched(mark)
            ranks = [p for p in procs if "RANK" in p.environ()]
            agent = [p for p in procs if "torch.distributed.run" in p.cmdline()]
            assert len(ranks) == 2 and len(agent) == 1, [p.cmdline() for p in procs]
            parent = agent[0].parent()  # the relaunching distill.py (its parent: accelerate's launcher)
            assert str(REPO / "train" / "distill.py") in parent.cmdline() and "RANK" not in parent.environ()
            assert "accelerate.commands.launch" in parent.parent().cmdline()
            if sig == "ctrl-c":
                os.killpg(proc.pid, signal.SIGINT)  # accelerate and the relaunching distill.py (the ranks: own session)
            else:
                parent.send_signal(sig)
            name = sig if sig == "ctrl-c" else sig.name
            deadline = time.time() + 60
            while time.time() < deadline and launched(mark):
                time.sleep(0.2)
            left = [p.cmdline() for p in launched(mark)]
            err.seek(0)
            assert not left, f"still running 60 s after {name}: {left}\n{err.read()[-3000:]}"
            if sig != signal.SIGKILL:
                k = len(jsonl(out / "metrics.jsonl"))
                assert (out / "latest").read_text().strip() == f"step-{k}" and 2 <= k < 5000
        finally:
            signal_all(launched(mark), signal.SIGKILL)
            proc.wait(timeout=30)


def fake_launcher(monkeypatch, tmp_path, launcher, use_cpu="True", master_port="29500", default_cfg=None,
                  cuda=False) -> list:
    """This process as the script that `accelerate launch <launcher> train/distill.py` started through its simple
    launcher (its environment, its command line in /proc/<parent>/cmdline, accelerate's default config file
    ``default_cfg``, CUDA or not); returns the list that collects the (command, environment) of each rank launch
    (distill.run_ranks, not run). ``{cfg}`` in ``launcher`` is a config file's path (tmp_path/accelerate.yaml)."""
    import pathlib

    from accelerate.commands.config import config_args

    from train import distill

    cmdline = "\0".join([sys.executable, "-m", "accelerate.commands.launch",
                         *[a.replace("{cfg}", str(tmp_path / "accelerate.yaml")) for a in launcher],
                         str(REPO / "train" / "distill.py"), "--config", "x.yaml"])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", use_cpu)  # accelerate's str(args.cpu or args.use_cpu)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", master_port)
    monkeypatch.setattr(os, "getppid", lambda: 987654)
    real = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes",
                        lambda p: cmdline.encode() if str(p) == "/proc/987654/cmdline" else real(p))
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    if default_cfg is not None:
        default.parent.mkdir(parents=True)
        default.write_text(yaml.safe_dump(default_cfg))
    monkeypatch.setattr(config_args, "default_config_file", str(default))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(cuda))
    calls = []
    monkeypatch.setattr(distill, "run_ranks", lambda cmd, env=None: calls.append((cmd, env)) or 0)
    return calls


def ranks_cmd(n: int, meet: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", *meet,
            str(REPO / "train" / "distill.py"), "--config", "x.yaml"]


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
    from train import distill

    if file_cfg is not None:
        (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(file_cfg))
    calls = fake_launcher(monkeypatch, tmp_path, launcher, master_port=master_port)
    rc = distill.relaunch_cpu_ranks(["--config", "x.yaml"])
    if meet is None:
        assert rc is None and calls == []
        return
    assert rc == 0 and calls == [(ranks_cmd((file_cfg or {}).get("num_processes", 2), meet), None)]


@pytest.mark.parametrize("launcher, use_cpu, default_cfg, master_port, n, meet", [
    # the rank count from accelerate's default config file (no --num_processes, no --config_file): was one rank
    ([], "True", {"num_processes": 2, "use_cpu": True}, "29500", 2, ["--standalone"]),
    ([], "False", {"num_processes": 3, "main_process_port": 29555}, "29555", 3,
     ["--master_addr=127.0.0.1", "--master_port=29555"]),
    # no --cpu on a machine without CUDA: was one rank
    (["--num_processes", "2"], "False", None, "29500", 2, ["--standalone"]),
    # --cpu skips the default config file (accelerate then starts 1 process); an explicit count still wins over it
    (["--cpu"], "True", {"num_processes": 2}, "29500", None, None),
    (["--num_processes", "2"], "True", {"num_processes": 4}, "29500", 2, ["--standalone"]),
], ids=["default-config", "default-config-port", "no-cpu-flag", "cpu-skips-default-config", "flag-over-default"])
def test_every_requested_cpu_rank_runs(monkeypatch, tmp_path, launcher, use_cpu, default_cfg, master_port, n, meet):
    """relaunch_cpu_ranks resolves the rank count as accelerate does (--num_processes, --config_file, else without
    --cpu accelerate's default config file) and starts that many CPU ranks, also for a launch without --cpu on a
    machine without CUDA (its ranks then get ACCELERATE_USE_CPU=true); never one rank for a launch of several."""
    from train import distill

    calls = fake_launcher(monkeypatch, tmp_path, launcher, use_cpu, master_port, default_cfg)
    rc = distill.relaunch_cpu_ranks(["--config", "x.yaml"])
    if n is None:
        assert rc is None and calls == []
        return
    assert rc == 0 and [c[0] for c in calls] == [ranks_cmd(n, meet)]
    env = calls[0][1]
    assert env is None if use_cpu == "True" else env["ACCELERATE_USE_CPU"] == "true"


@pytest.mark.parametrize("launcher, use_cpu, default_cfg, file_cfg, cuda, message", [
    (["--num_processes", "2"], "False", None, None, True, "num_processes = 2 (--num_processes), but accelerate "
     "launch started train/distill.py once: 1 GPU(s) visible and no --multi_gpu"),
    ([], "False", {"num_processes": 2}, None, True, "num_processes = 2 (accelerate's default config file {default})"),
    (["--cpu", "--num_processes", "4", "--num_machines", "2"], "True", None, None, False,
     "num_machines = 2 (--num_machines): train/distill.py starts the CPU ranks of one machine only"),
    (["--cpu", "--config_file", "{cfg}"], "True", None, {"num_processes": "two"}, False,
     "num_processes = 'two' (--config_file {cfg}): expected an integer"),
], ids=["one-gpu", "one-gpu-default-config", "two-machines", "count-not-an-int"])
def test_a_launch_of_ranks_that_cannot_run_is_refused(monkeypatch, tmp_path, capsys, launcher, use_cpu, default_cfg,
                                                       file_cfg, cuda, message):
    """A launch of N > 1 processes that would train as one rank (one GPU, no --cpu: accelerate starts the script
    once) or as the wrong ranks (several machines) ends with exit code 2 and an error naming the setting, its
    value and where it came from; no rank starts."""
    from train import distill

    if file_cfg is not None:
        (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(file_cfg))
    calls = fake_launcher(monkeypatch, tmp_path, launcher, use_cpu, default_cfg=default_cfg, cuda=cuda)
    assert distill.main(["--config", str(CONFIG)]) == 2 and calls == []
    err = capsys.readouterr().err
    assert "error: " + message.format(default=tmp_path / "hf" / "accelerate" / "default_config.yaml",
                                      cfg=tmp_path / "accelerate.yaml") in err


def test_a_launch_of_fewer_than_one_process_is_refused(monkeypatch, tmp_path, capsys):
    """accelerate launch --num_processes 0 (or -1) runs the script once with no MASTER_ADDR: refused by name instead
    of training one rank."""
    from train import distill

    for n in ("0", "-1"):
        calls = fake_launcher(monkeypatch, tmp_path, ["--cpu", "--num_processes", n])
        monkeypatch.delenv("MASTER_ADDR")  # accelerate's simple launcher of one process exports none
        assert distill.main(["--config", str(CONFIG)]) == 2 and calls == []
        assert f"error: num_processes = {n} (--num_processes): give at least 1 process" in capsys.readouterr().err
    calls = fake_launcher(monkeypatch, tmp_path, ["--cpu", "--num_processes", "1"])
    monkeypatch.delenv("MASTER_ADDR")
    assert distill.relaunch_cpu_ranks(["--config", "x.yaml"]) is None and calls == []  # one process: this one


def test_graceful_interrupt_takes_a_second_signal_soon_after_as_the_same_request(monkeypatch):
    """GracefulInterrupt: the first SIGINT or SIGTERM sets the flag; a second within SAME_REQUEST_S (a terminal's
    Ctrl-C, then accelerate's SIGTERM to every process) changes nothing; one later aborts (KeyboardInterrupt)."""
    from train import distill

    now = [100.0]
    monkeypatch.setattr(distill.time, "monotonic", lambda: now[0])
    g = distill.GracefulInterrupt(announce=False)
    try:
        assert signal.getsignal(signal.SIGTERM) == g._handle and signal.getsignal(signal.SIGINT) == g._handle
        g._handle(signal.SIGINT, None)
        assert g.flag
        now[0] += 0.5
        g._handle(signal.SIGTERM, None)  # the launcher's SIGTERM after the terminal's SIGINT
        now[0] += distill.GracefulInterrupt.SAME_REQUEST_S
        with pytest.raises(KeyboardInterrupt):
            g._handle(signal.SIGINT, None)  # the user's second Ctrl-C
    finally:
        g.restore()
    assert signal.getsignal(signal.SIGTERM) != g._handle and signal.getsignal(signal.SIGINT) != g._handle


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_rank_leaves_with_its_code_and_its_output(world):
    """leave_rank: a rank of a multi-process launch (WORLD_SIZE > 1) ends with os._exit after flushing what it
    printed (its teardown is skipped); a single process exits through SystemExit. Same code and output either way."""
    code = ("import sys; from train.distill import leave_rank; print('out', end=''); print('err', end='', "
            "file=sys.stderr); leave_rank(3)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WORLD_SIZE": world})
    assert (r.returncode, r.stdout, r.stderr[-3:]) == (3, "out", "err")


def test_sigusr1_prints_the_stacks_and_the_process_goes_on():
    """dump_stacks_on_sigusr1 (installed by main() in every training process): SIGUSR1 prints each thread's Python
    stack to stderr and the process carries on; rank_stacks keeps exactly those lines."""
    code = ("import os, signal, sys, time; from train.distill import dump_stacks_on_sigusr1 as d; d()\n"
            "def waiting_here():\n    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2)\n"
            "waiting_here(); print('went on')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, "went on\n"), r.stderr[-2000:]
    stacks = rank_stacks(r.stderr).splitlines()
    assert stacks[0].startswith("Current thread 0x") and "most recent call first" in stacks[0]
    assert stacks[1].startswith('  File "<string>", line 3 in waiting_here') and len(stacks) == 3


def test_rank_stacks_keeps_the_dumps_and_drops_the_rest():
    """Headers anywhere in a line (behind a progress bar or a rank prefix) from the header on, faulthandler's frames
    (no comma before "in"), the garbage-collection and no-frame markers; not tracebacks' frames or other output."""
    err = ("step 3 loss 2.1\n"
           "Traceback (most recent call last):\n"
           '  File "/x/launch.py", line 10, in main\n'
           "RuntimeError: boom\n"
           " 50%|#####     | 20/40 [00:03<00:03]Fatal Python error: Aborted\n"
           "\n"
           "[rank1]: Thread 0x00007f01 (most recent call first):\n"
           '[rank1]:   File "/r/distill.py", line 69 in main\n'
           "  Garbage-collecting\n"
           "Current thread 0x00007f02 (most recent call first):\n"
           "  <no Python frame>\n")
    assert rank_stacks(err).splitlines() == [
        "Fatal Python error: Aborted", "Thread 0x00007f01 (most recent call first):",
        '[rank1]:   File "/r/distill.py", line 69 in main', "Garbage-collecting",
        "Current thread 0x00007f02 (most recent call first):", "<no Python frame>"]
    assert rank_stacks("no dump here\n") == "(none in stderr)"


def test_rotation_keeps_the_checkpoint_just_saved_after_resuming_an_earlier_one(tmp_path):
    """rotate_checkpoints: a run resumed from step-200 beside an abandoned step-300 saves step-213; keep_last 1 keeps
    step-213 (sorted by step alone it was deleted and `latest` named a missing folder), keep_last 2 keeps step-200 and
    step-213 (the abandoned step-300 goes first), 0 keeps all; folders not named step-<digits> are never touched."""
    from train.distill import rotate_checkpoints

    def make(names):
        for n in names:
            (tmp_path / n).mkdir()
            (tmp_path / n / "trainer_state.json").write_text("{}")

    make(["step-200", "step-300", "step-213", "step-x", "steps"])
    assert rotate_checkpoints(tmp_path, 213, 0) == []
    assert sorted(p.name for p in rotate_checkpoints(tmp_path, 213, 2)) == ["step-300"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-200", "step-213", "step-x", "steps"]
    make(["step-300"])
    assert sorted(p.name for p in rotate_checkpoints(tmp_path, 213, 1)) == ["step-200", "step-300"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-213", "step-x", "steps"]
    # an ordinary run: the oldest go
    make(["step-100", "step-150"])
    assert sorted(p.name for p in rotate_checkpoints(tmp_path, 213, 2)) == ["step-100"]


@pytest.mark.slow
def test_trainer_refuses_bad_data_and_changed_resume(stories_dir, tmp_path):
    from tests.helpers import distill_cases

    data = tmp_path / "train.jsonl"
    assert sample_main(["--target", str(stories_dir), "--num", "32", "--max-new-tokens", "24", "--batch-size", "32",
                        "--out", str(data)]) == 0
    base = ["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), f"target={stories_dir}", "eval=null",
            "eval_prompts=0", "micro_batch_size=4", "log_every=1"]

    def run(*extra):
        return [*base, *extra]

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    nomask = tmp_path / "nomask.jsonl"
    nomask.write_text("".join(json.dumps({**r, "loss_mask": [0] * len(r["loss_mask"])}) + "\n" for r in rows))
    oov = tmp_path / "oov.jsonl"
    oov.write_text("".join(json.dumps({**r, "input_ids": [9999] * len(r["input_ids"])}) + "\n" for r in rows))
    out = tmp_path / "c"
    # the runs up to the truncated checkpoint one after the other in one child process (tests.helpers.distill_cases),
    # out/config.yaml and out/metrics.jsonl read after each
    runs = distill_cases([run(f"train={nomask}", f"output_dir={tmp_path / 'a'}", "max_steps=2"),
                          run(f"train={oov}", f"output_dir={tmp_path / 'b'}", "max_steps=2"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=4", "save_every=2"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=6", "lr=1.0"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=6", "save_every=2"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=3")],
                         read_after=[out / "config.yaml", out / "metrics.jsonl"])
    r = runs[0]
    assert r.returncode == 2 and "nothing to train on" in r.stderr
    r = runs[1]
    assert r.returncode == 2 and "token id 9999" in r.stderr
    assert runs[2].returncode == 0
    before = runs[2].files[str(out / "config.yaml")]
    r = runs[3]
    assert r.returncode == 2 and "lr: 0.003 -> 1.0" in r.stderr
    assert r.files[str(out / "config.yaml")] == before  # a refused resume changes nothing
    assert runs[4].returncode == 0
    steps = [json.loads(x)["step"] for x in runs[4].files[str(out / "metrics.jsonl")].splitlines() if '"loss"' in x]
    assert steps == [1, 2, 3, 4, 5, 6]
    # was: a warning and exit 0 without training
    r = runs[5]
    assert r.returncode == 2 and "checkpoint is at step 6 but this run has 3 total steps" in r.stderr
    weights = out / "step-6" / "state" / "model.safetensors"  # was: a SafetensorError traceback
    weights.write_bytes(weights.read_bytes()[:100])
    r = subprocess.run([sys.executable, str(REPO / "train" / "distill.py"), *run(f"train={data}", f"output_dir={out}",
                        "max_steps=8")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"resume from {out / 'step-6'}: cannot read its state/" in r.stderr
    assert f"resume_from=<step-N folder> (available: {out / 'step-4'})" in r.stderr  # keep_last=2


def _distill_argv(*extra):
    return ["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), "eval=null", "eval_prompts=0", "max_steps=1",
            *extra]


def _distill(*extra):
    cmd = [sys.executable, str(REPO / "train" / "distill.py"), *_distill_argv(*extra)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)


def test_distill_checks_every_train_row_before_step_1(stories_dir, tmp_path):
    """A row with a token id outside the target's vocabulary, deep in the file, stops the run before the
    first step with file:line and the field (it used to surface only when a step drew that row)."""
    rows = [json.dumps({"input_ids": [1] + [(7 * i + k) % 500 + 1 for k in range(30)], "loss_mask": [0] + [1] * 30})
            for i in range(40)]
    rows[33] = json.dumps({"input_ids": [1, 5, 99999, 6], "loss_mask": [0, 1, 1, 1]})
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    r = _distill(f"target={stories_dir}", f"train={data}", "micro_batch_size=4", f"output_dir={tmp_path / 'out'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"config key 'train': {data}:34: field 'input_ids' holds token id 99999 >= the target's vocabulary" \
        in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before the loop opened it


@pytest.mark.slow
def test_distill_value_errors_are_one_line(stories_dir, tmp_path):
    from dspine import init as init_cli
    from tests.helpers import distill_cases

    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    other = tmp_path / "other-draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(other), "--layers", "1", "--mask-token-id", "0",
                          "--block-size", "8", "--dtype", "fp32"]) == 0
    broken = tmp_path / "broken"
    (broken / "step-2").mkdir(parents=True)
    (broken / "step-2" / "trainer_state.json").write_text("{}")
    (broken / "latest").write_text("step-2")

    data = tmp_path / "train.jsonl"
    assert sample_main(["--target", str(stories_dir), "--num", "16", "--max-new-tokens", "16", "--batch-size", "16",
                        "--out", str(data)]) == 0
    cases = [
        (("mask_token_id=9999",), "mask_token_id=9999 is outside the vocabulary"),
        (("target_layer_ids=[1,99]",), "[99] outside [0, "),
        (("block_size=300", "max_length=512"), "draft RoPE range shorter than the requested context"),
        ((f"train={conv}",), f"{conv}:1 is a conversation, not tokenized rows: run python -m data.tokenize first"),
        ((f"train={few}",), "config key 'train': 1 rows are fewer than one global batch of 4"),
        ((f"init_from={other}",), f"config key 'init_from': {other}: layers 1 in the source, 2 in the model"),
        ((f"output_dir={broken}",), f"points to {broken / 'step-2'}, an incomplete checkpoint (no state)"),
    ]
    runs = distill_cases([_distill_argv(f"target={stories_dir}", f"train={data}", "micro_batch_size=4",
                                        f"output_dir={tmp_path / 'out'}", *extra) for extra, _ in cases])
    for (extra, message), r in zip(cases, runs, strict=True):  # one child process for all the cases
        assert r.returncode == 2 and "Traceback" not in r.stderr, (extra, r.stderr[-2000:])
        assert message in r.stderr, (extra, r.stderr[-2000:])


def test_a_ctrl_c_before_any_checkpoint_says_so_and_leaves_no_empty_output_dir(monkeypatch, tmp_path, capsys):
    """A KeyboardInterrupt outside the steps (the set-up, a second Ctrl-C) exits 130 with one line: with no
    checkpoint written it says so (not "keeps its last checkpoint") and a fresh, still empty output_dir is removed;
    with one, it names the resume."""
    from train import distill

    def interrupted(cfg):
        os.makedirs(cfg.output_dir, exist_ok=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "train", interrupted)
    out = tmp_path / "run"
    assert distill.main(["--config", str(CONFIG), f"output_dir={out}"]) == 130
    assert "interrupted: no checkpoint was written" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    (out / "latest").write_text("step-3\n")
    assert distill.main(["--config", str(CONFIG), f"output_dir={out}"]) == 130
    assert f"interrupted: {out} keeps its last checkpoint, and resume_from=auto continues" in capsys.readouterr().err
    assert (out / "latest").read_text() == "step-3\n"


def test_a_second_run_on_an_output_dir_in_use_is_refused(monkeypatch, tmp_path, capsys):
    """Two runs on one output_dir: the second resumed from the first's latest checkpoint while the first went on, both
    writing the same step-N folders and metrics.jsonl (newcomer review); refused while rank 0 of a run holds it."""
    from dspine.io import folder_lock
    from train import distill

    monkeypatch.setattr(distill, "train", lambda cfg: 0)
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    with folder_lock(out):  # a run in progress (flock: another open of the folder, in this process too, is refused)
        assert distill.main(["--config", str(CONFIG), f"output_dir={out}"]) == 2
    assert f"error: BlockingIOError: {out}: another run is writing this folder" in capsys.readouterr().err
    assert distill.main(["--config", str(CONFIG), f"output_dir={out}"]) == 0


def test_a_step_that_raises_gives_the_signal_handlers_back(monkeypatch, tmp_path, capsys, data):
    """The trainer's Ctrl-C/SIGTERM handlers (stop after the step) are put back when a step raises, not only after
    the last step: an in-process caller (a notebook, a test) keeps its Ctrl-C (they leaked; a later SIGINT in the same
    process only set the finished run's flag)."""
    import signal

    from train import distill

    def second_ctrl_c(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "train_step", second_ctrl_c)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert distill.main(["--config", str(CONFIG), *data[1], "max_steps=2", f"output_dir={tmp_path / 'run'}"]) == 130
    assert "interrupted: no checkpoint was written" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before


def test_an_output_dir_holding_a_draft_is_refused_and_left_as_it_was(stories_dir, tmp_path, capsys):
    """output_dir naming a draft (or model) folder: refused before anything is written. The run's config.json
    replaced the draft's, which no loader could read afterwards."""
    from dspine import init as init_cli
    from train import distill

    draft = tmp_path / "draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(draft), "--layers", "1", "--mask-token-id", "0"]) == 0
    before = {p.name: p.read_bytes() for p in draft.iterdir()}
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1] + [(7 * i + k) % 500 + 1 for k in range(30)],
                                        "loss_mask": [0] + [1] * 30}) + "\n" for i in range(16)))
    capsys.readouterr()
    assert distill.main(["--config", str(CONFIG), f"target={stories_dir}", f"train={data}", "eval=null",
                         "eval_prompts=0", "max_steps=1", f"output_dir={draft}"]) == 2
    assert f"config key 'output_dir': {draft} holds a config.json that no training run wrote" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in draft.iterdir()} == before


def test_truncate_jsonl_drops_a_torn_last_line_and_names_a_bad_row(tmp_path):
    """A resume truncates metrics.jsonl to its checkpoint's step: a last line cut off by a kill is dropped (it was a
    JSONDecodeError traceback, and the run could not resume), a bad row before it is one error naming file and line."""
    from train.distill import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "eval/loss": 1.4}, {"step": 3, "loss": 1.2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    truncate_jsonl(path, 2, drop_eval=True)
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:2]
    path.write_text('{"step": 1}\n\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not a metrics row .*'not json'"):  # the file's line
        truncate_jsonl(path, 2)
    assert path.read_text() == '{"step": 1}\n\nnot json\n{"step": 2}\n'  # left as it was
