"""Target layer types (issue 14): sliding-window and hybrid targets.

Unsupported layer types are refused by every entry point before any weight is read (regression test
of the late failure on a Qwen3-Next target); tiny random targets are built from transformers' config
classes and saved to tmp folders (no Hub access).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dspine.config import check_target_layers, target_layer_types, unsupported_layers


@pytest.fixture(scope="module")
def tiny_next_dir(tmp_path_factory, qwen3_tokenizer_dir):
    """A tiny random Qwen3-Next (3 linear-attention layers + 1 full, 2 experts) with the Qwen3 tokenizer."""
    from transformers import AutoTokenizer, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=4096,
        eos_token_id=151645, pad_token_id=151643,
    )
    out = tmp_path_factory.mktemp("tiny_next")
    Qwen3NextForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_qwen3_dir):
    """A draft made by dspine.init for the tiny Qwen3 (same width and depth as the tiny Qwen3-Next)."""
    from dspine.init import main

    out = tmp_path_factory.mktemp("draft") / "d"
    assert main(["--target", str(tiny_qwen3_dir), "--out", str(out), "--layers", "1", "--block-size", "4",
                 "--dtype", "fp32"]) == 0
    return out


@pytest.fixture
def no_weights(monkeypatch):
    """Loading target weights fails the test: the refusal must come first."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("target weights were loaded before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_layer_types_follow_transformers_rule():
    from transformers import Qwen3Config, Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    swa = Qwen3Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert swa.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    assert check_target_layers(swa, "t") == [None, 8, 8, 8]
    # the same rule on a config.json dict without layer_types (older Qwen2/Qwen3 files)
    raw = {"model_type": "qwen3", "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 8,
           "max_window_layers": 3}
    assert check_target_layers(raw, "t") == [None, None, None, 8]
    assert check_target_layers({**raw, "use_sliding_window": False}, "t") == [None] * 4
    assert check_target_layers(Qwen3Config(num_hidden_layers=2, sliding_window=8), "t") == [None, None]

    nxt = Qwen3NextConfig(num_hidden_layers=4)
    assert unsupported_layers(nxt) == [] and unsupported_layers(nxt, engine=False) == []  # both paths run it
    assert check_target_layers(nxt, "t") == check_target_layers(nxt, "t", engine=False) == [None] * 4
    q35 = Qwen3_5Config(text_config={"num_hidden_layers": 8})
    assert target_layer_types(q35) == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert unsupported_layers(q35) == [
        "model_type='qwen3_5' (hybrid: gated delta-rule linear attention with a recurrent state) is not implemented "
        "by the engine (it runs the text models qwen3_next / qwen3_5_text)",
        "layer_types has 'linear_attention' (layers [0, 1, 2, 4, 5, 6])"]
    assert unsupported_layers(q35, engine=False) == [
        "model_type='qwen3_5' (hybrid: gated delta-rule linear attention with a recurrent state) is not implemented "
        "by the reference path (it runs the text models qwen3_next / qwen3_5_text)"]
    with pytest.raises(ValueError, match="'linear_attention' \\(layers \\[0, 1, 2, 4, 5, 6\\]\\).*not supported "
                                         "\\(the engine"):
        check_target_layers(q35, "target x")
    bad = {"model_type": "qwen3", "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    assert unsupported_layers(bad) == ["sliding_attention layers with sliding_window=None"]


@pytest.fixture(scope="module")
def qwen35_vl_dir(tmp_path_factory, qwen3_tokenizer_dir):
    """A multimodal qwen3_5 config.json (text_config with linear-attention layers), no weights: every
    entry point must refuse it from the config alone."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    out = tmp_path_factory.mktemp("qwen35_vl")
    Qwen3_5Config(text_config={"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 151936}).save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir).save_pretrained(out)
    return out


NAMED = "'linear_attention' (layers [0, 1, 2])"


def test_hybrid_text_target_passes_check(tiny_next_dir, draft_dir, capsys, no_weights):
    """Both paths run qwen3_next (tests/test_hybrid_target.py, tests/test_hybrid_engine.py): no engine note."""
    from dspine.check import main as check

    assert check(["--target", str(tiny_next_dir), "--draft", str(draft_dir)]) == 0
    out = capsys.readouterr().out
    assert "engine:" not in out and "use the reference backend" not in out


def test_multimodal_qwen35_refused_everywhere(qwen35_vl_dir, draft_dir, tmp_path, capsys, no_weights):
    from data.regenerate import main as regenerate
    from dspine.check import main as check
    from dspine.init import main as init
    from infer.bench import main as bench
    from infer.generate import main as generate
    from train.distill import main as distill

    t = str(qwen35_vl_dir)
    assert check(["--target", t, "--draft", str(draft_dir)]) == 1
    out = capsys.readouterr().out
    assert "model_type='qwen3_5'" in out and "text models qwen3_next / qwen3_5_text" in out and "MISMATCH" in out
    assert init(["--target", t, "--out", str(tmp_path / "new")]) == 2
    assert "model_type='qwen3_5'" in capsys.readouterr().err and not (tmp_path / "new").exists()
    for d in (["--draft", str(draft_dir)], ["--draft", "none"]):
        assert generate(["--target", t, *d, "--prompt", "hi", "--max-new-tokens", "4"]) == 2
        assert "model_type='qwen3_5'" in capsys.readouterr().err
    out_json = tmp_path / "b.json"
    assert bench(["--target", t, "--draft", str(draft_dir), "--datasets", "gsm8k", "--num-prompts", "1",
                  "--max-new-tokens", "4", "--output-json", str(out_json)]) != 0
    assert "model_type='qwen3_5'" in capsys.readouterr().err and not out_json.exists()
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": "0", "conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    assert regenerate(["--input", str(rows), "--output", str(tmp_path / "regen"), "--target", t,
                       "--backend", "hf"]) == 2
    assert "model_type='qwen3_5'" in capsys.readouterr().err and not (tmp_path / "regen").exists()
    assert distill([f"target={t}", f"train={rows}", f"output_dir={tmp_path / 'run'}", "eval=null"]) == 2
    err = capsys.readouterr().err
    assert "config key 'target'" in err and "model_type='qwen3_5'" in err and not (tmp_path / "run").exists()


def test_engine_paths_refuse_multimodal_hybrid_target(qwen35_vl_dir, tmp_path, capsys, no_weights):
    """The engine (EngineTarget, data.regenerate --backend engine) refuses a multimodal qwen3_5 target before
    any weights load, naming the model and layer type (infer.generate / infer.bench --backend cuda call the
    same TargetSpec.check_supported(engine=True) once a GPU is there)."""
    from data.regenerate import main as regenerate
    from infer.model import EngineTarget

    with pytest.raises(ValueError, match="model_type='qwen3_5'.*'linear_attention' \\(layers \\[0, 1, 2\\]\\)"):
        EngineTarget.from_pretrained(str(qwen35_vl_dir), device="cpu", dtype=torch.float32, impl="torch")
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": "0", "conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    assert regenerate(["--input", str(rows), "--output", str(tmp_path / "regen"), "--target", str(qwen35_vl_dir),
                       "--backend", "engine"]) == 2
    assert NAMED in capsys.readouterr().err and not (tmp_path / "regen").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
