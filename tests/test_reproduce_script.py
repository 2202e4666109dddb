"""scripts/reproduce_h200.sh refuses what it cannot run before running anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *stages):
    env = {**os.environ, "RESULTS": str(tmp_path / "r"), "WORK": str(tmp_path / "w"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_h200.sh"), *stages], env=env, capture_output=True,
                          text=True, timeout=120)


def test_unknown_stage_is_refused(tmp_path):
    r = _run(tmp_path, "planner", "planswich")
    assert r.returncode == 2 and "unknown stage 'planswich'" in r.stderr and "planswitch" in r.stderr
    assert not (tmp_path / "w").exists()  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_gpu_stage_without_cuda_is_refused(tmp_path):
    r = _run(tmp_path, "convert", "planswitch")
    assert r.returncode == 2 and "stage 'planswitch' needs a CUDA GPU" in r.stderr
    assert not (tmp_path / "w").exists()
