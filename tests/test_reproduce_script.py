"""scripts/reproduce_h200.sh refuses what it cannot run before running anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *stages, **extra):
    env = {**os.environ, **extra, "RESULTS": str(tmp_path / "r"), "WORK": str(tmp_path / "w"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_h200.sh"), *stages], env=env, capture_output=True,
                          text=True, timeout=120)


def test_unknown_stage_is_refused(tmp_path):
    r = _run(tmp_path, "planner", "planswich")
    assert r.returncode == 2 and "unknown stage 'planswich'" in r.stderr and "planswitch" in r.stderr
    assert not (tmp_path / "w").exists()  # nothing ran


@pytest.mark.parametrize("env, value", [("PLAN_STATE", "bogus"), ("PLAN_DRAIN", "persist_len")])
def test_planfair_refuses_an_unknown_state_or_drain_model_before_any_stage(tmp_path, env, value):
    r = _run(tmp_path, "planner", "planfair", **{env: value})
    assert r.returncode == 2 and f"{env}={value!r}: expected one of" in r.stderr
    assert not (tmp_path / "w").exists()  # nothing ran


@pytest.mark.parametrize("runs", ["bogus", "0", "-1"])
def test_runs_must_be_a_count_before_any_stage(tmp_path, runs):
    r = _run(tmp_path, "planner", "planstate", RUNS=runs)
    assert r.returncode == 2 and f"RUNS={runs}: expected a count >= 1" in r.stderr
    assert not (tmp_path / "w").exists()  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_gpu_stage_without_cuda_is_refused(tmp_path):
    r = _run(tmp_path, "convert", "planswitch")
    assert r.returncode == 2 and "stage 'planswitch' needs a CUDA GPU" in r.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("weights, expected", [(None, []), ("gate_up down", ["--weights", "gate_up", "down"])])
def test_linearwide_takes_wide_weights(tmp_path, weights, expected):
    """WIDE_WEIGHTS names the weights tune_linear_fast.py --wide tunes (default: all of them); a stand-in python on
    PATH answers the CUDA checks and records the benchmark's arguments."""
    bin_dir, log = tmp_path / "bin", tmp_path / "argv.txt"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then echo NVIDIA_H200; exit 0; fi\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "RESULTS": str(tmp_path / "r"), "WORK": str(tmp_path / "w"),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("WIDE_WEIGHTS", None)
    if weights is not None:
        env["WIDE_WEIGHTS"] = weights
    r = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_h200.sh"), "linearwide"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = log.read_text().split()
    assert argv == ["benchmarks/kernels/tune_linear_fast.py", "--wide", *expected, "--output",
                    str(tmp_path / "r" / "linear-fast-wide-h200.json"), "--write-tuned",
                    "dspine/ops/tuned/linear-NVIDIA_H200.json"]
