"""Provenance of result files (dspine.provenance): the command line as recorded and the engine switches kept."""

from __future__ import annotations


def test_provenance_command_line_forms():
    from dspine.provenance import command_line

    assert command_line(["bash", "scripts/stories260k/ablation.sh"]) == "bash scripts/stories260k/ablation.sh"
    assert command_line(["scripts/make_tables.py", "--check"]) == "python scripts/make_tables.py --check"
    assert command_line(["infer/bench.py", "--num-prompts", "4"]) == "python -m infer.bench --num-prompts 4"
    assert command_line(["train/distill.py", "a=1"]) == "accelerate launch train/distill.py a=1"


def test_provenance_records_the_engine_switches_that_are_set(monkeypatch):
    """A result made with DSPINE_FUSE_NORM=auto says so (the command line does not); unset or empty ones are left
    out, and without any the key is absent (older files' schema)."""
    from dspine.provenance import ENGINE_ENV, provenance

    for k in ENGINE_ENV:
        monkeypatch.delenv(k, raising=False)
    assert "env" not in provenance(["x"])
    monkeypatch.setenv("DSPINE_FUSE_NORM", "auto")
    monkeypatch.setenv("DSPINE_PDL", "")
    assert provenance(["x"])["env"] == {"DSPINE_FUSE_NORM": "auto"}
