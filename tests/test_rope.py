"""RoPE the draft and the engine do not implement is refused everywhere, never decoded as full RoPE."""

from __future__ import annotations

import json

import pytest
import torch

from dspine.config import DSpineConfig, check_rope, unsupported_rope

UNSUPPORTED = [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, "rope_type='yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
]


def tiny_target(folder, family="qwen3", **over):
    """A tiny random Qwen3 or Llama saved as an HF folder (config + safetensors, no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    Config, Model = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    torch.manual_seed(0)
    cfg = Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=256, eos_token_id=1, pad_token_id=2,
                 bos_token_id=0, tie_word_embeddings=False, **over)
    Model(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("over,field", UNSUPPORTED)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_target_rope_is_refused_by_check_loader_and_engine(tmp_path, family, over, field, capsys):
    from dspine import check as check_cli
    from dspine import init as init_cli
    from dspine.target import TargetSpec, check_compat, load_target
    from infer.model import EngineTarget, ModelArgs

    plain = tiny_target(tmp_path / "plain", family)
    draft = tmp_path / "draft"
    assert init_cli.main(["--target", str(plain), "--out", str(draft), "--layers", "1", "--mask-token-id", "5",
                          "--dtype", "fp32"]) == 0
    bad = tiny_target(tmp_path / "bad", family, **over)
    # dspine.check: a failing row naming the field, exit 1 (was: OK)
    row = next(r for r in check_compat(TargetSpec.from_pretrained(str(bad)), DSpineConfig.from_pretrained(draft))
               if r.field == "rope")
    assert not row.ok and field in str(row.target)
    capsys.readouterr()
    assert check_cli.main(["--target", str(bad), "--draft", str(draft)]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and field in out
    # the reference loader and the engine's config reader refuse it, naming the field
    with pytest.raises(ValueError, match=f"{field}.*is not implemented"):
        load_target(str(bad), dtype="fp32")
    with pytest.raises(ValueError, match=f"{field}.*is not implemented"):
        ModelArgs.from_hf_config(json.loads((bad / "config.json").read_text()))
    with pytest.raises(ValueError, match=f"{field}.*is not implemented"):
        EngineTarget.from_pretrained(str(bad), device="cpu", dtype=torch.float32, impl="torch")
    # a draft cannot be sized for it
    assert init_cli.main(["--target", str(bad), "--out", str(tmp_path / "d2"), "--mask-token-id", "5"]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_plain_rope_passes(tmp_path, family):
    from dspine.target import TargetSpec, load_target
    from infer.model import ModelArgs

    folder = tiny_target(tmp_path / "t", family)
    assert TargetSpec.from_pretrained(str(folder)).rope_problems == []
    load_target(str(folder), dtype="fp32")
    ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    for cfg in ({"rope_scaling": None, "rope_theta": 1e6}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
                {"partial_rotary_factor": 1.0, "head_dim": 16, "rotary_dim": 16}, {"no_rope_layers": [1, 1]}):
        assert unsupported_rope(cfg) == [], cfg


@pytest.mark.parametrize("cfg,field", [
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "linear"}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ({"rotary_pct": 0.25}, "rotary_pct=0.25"),
    ({"rotary_dim": 8, "head_dim": 16}, "rotary_dim=8"),
    ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers=[1, 0, 1]"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear'"),
])
def test_every_unimplemented_rope_field_is_named(cfg, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_rope(cfg, "target x")


@pytest.mark.parametrize("over,field", [({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
                                        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
                                        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
                                         "rope_parameters.partial_rotary_factor=0.5")])
def test_draft_config_refuses_unimplemented_rope(tmp_path, over, field):
    from dspine.checkpoint import load_config
    from tests.test_config_checkpoint import small_config

    with pytest.raises(ValueError, match=field):
        small_config(**over)
    small_config().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **over}))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}.*{field}"):
        load_config(tmp_path)
