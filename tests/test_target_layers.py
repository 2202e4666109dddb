"""Target layer types (issue 14): sliding-window and hybrid targets.

Unsupported layer types are refused by every entry point before any weight is read (regression test
of the late failure on a Qwen3-Next target); tiny random targets are built from transformers' config
classes and saved to tmp folders (no Hub access).
"""

from __future__ import annotations

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
    q35 = Qwen3_5Config(text_config={"num_hidden_layers": 8})  # multimodal: its text model is the target
    assert target_layer_types(q35) == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert unsupported_layers(q35) == [] and unsupported_layers(q35, engine=False) == []
    assert check_target_layers(q35, "t") == [None] * 8  # tests/test_multimodal_target.py: loading and decoding
    bad = {"model_type": "qwen3", "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    assert unsupported_layers(bad) == ["sliding_attention layers with sliding_window=None"]


def test_hybrid_text_target_passes_check(tiny_next_dir, draft_dir, capsys, no_weights):
    """Both paths run qwen3_next (tests/test_hybrid_target.py, tests/test_hybrid_engine.py): no engine note."""
    from dspine.check import main as check

    assert check(["--target", str(tiny_next_dir), "--draft", str(draft_dir)]) == 0
    out = capsys.readouterr().out
    assert "engine:" not in out and "use the reference backend" not in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
