"""Multimodal Qwen3.5 checkpoints (issue 14): the real Qwen3.5 releases are ``qwen3_5`` configs with a
``text_config`` (qwen3_5_text) and a vision tower, the text model's tensors under ``model.language_model.``.
DSpine runs their text model as the target: a tiny random ``Qwen3_5ForConditionalGeneration`` (3 gated
delta-rule layers + 1 gated full-attention layer, vocab 256, a one-block vision tower), fp32 on the CPU.

The reference target's logits and features, and the engine torch path's prefill logits and features, equal
the multimodal model's own (text-only input, the same saved weights); ``dspine.init`` writes a draft for it
and ``dspine.check`` passes; other multimodal configs are refused before any weight is read.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dspine.config import unsupported_layers
from dspine.target import _text_model_from_tensors, load_target
from tests.helpers import HYBRID_TEXT

LAYERS = [1, 3]  # feature layers; 3 is the last (read after the final norm)


def _config(tie: bool):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    text = {**HYBRID_TEXT, "tie_word_embeddings": tie}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def mm(request, tmp_path_factory):
    """(folder, transformers' outputs on a random 40-token text-only input: ids [40], logits [40, V], features
    [40, 2H] = hidden_states[2] ++ hidden_states[4])."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(_config(request.param)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # the engine folds the zero-centred norms: check the fold
                p.normal_(0.0, 0.2)
    out = tmp_path_factory.mktemp("qwen35_mm")
    model.save_pretrained(out)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.language_model.embed_tokens.weight" in keys and any(k.startswith("model.visual.") for k in keys)
    assert ("lm_head.weight" in keys) != request.param
    ids = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        o = model(input_ids=ids, output_hidden_states=True)
    hs = o.hidden_states
    return out, ids[0], o.logits[0], torch.cat([hs[LAYERS[0] + 1], hs[LAYERS[1] + 1]], dim=-1)[0]


def test_reference_target_is_the_text_model(mm):
    out, ids, logits, feats = mm
    target = load_target(str(out), dtype="fp32", layer_ids=LAYERS)
    assert target.config.model_type == "qwen3_5_text" and target.recurrent and target.num_layers == 4
    assert not any("visual" in n for n, _ in target.model.named_parameters())  # no vision tower in memory
    with torch.no_grad():
        got = target(ids[None])
        assert (got.logits[0] - logits).abs().max() < 1e-5
        assert (got.features[0] - feats).abs().max() < 1e-5
        assert (target.features(ids[None])[0] - feats).abs().max() < 1e-5
        # the fallback for a transformers without the multimodal -> text causal LM mapping: the same model
        own = _text_model_from_tensors(str(out), target.config.__class__.from_dict(target.config.to_dict()),
                                       torch.float32)
        assert (own(input_ids=ids[None]).logits[0] - logits).abs().max() < 1e-5


def test_engine_torch_prefill_equals_transformers(mm):
    from infer.model import EngineTarget

    out, ids, logits, feats = mm
    eng = EngineTarget.from_pretrained(str(out), device="cpu", dtype=torch.float32, layer_ids=LAYERS, impl="torch")
    assert eng.args.model_type == "qwen3_5_text" and eng.args.hybrid
    assert eng.args.tie_word_embeddings == (eng.lm_head is None) == (eng.head is eng.embed)
    cache = eng.new_cache(3, 64)
    lengths = (40, 23, 7)
    got, got_feats = eng.prefill_packed([ids[:n] for n in lengths], [0, 1, 2], cache)
    for i, n in enumerate(lengths):  # each prompt's last row
        assert (got[i] - logits[n - 1]).abs().max() < 1e-4
    assert (got_feats[:40] - feats).abs().max() < 1e-4


def test_init_and_check_pass(mm, tmp_path, capsys):
    from dspine.check import main as check
    from dspine.checkpoint import load_config
    from dspine.init import main as init

    out = mm[0]
    draft = tmp_path / "d"
    assert init(["--target", str(out), "--out", str(draft), "--layers", "1", "--block-size", "4",
                 "--dtype", "fp32"]) == 0
    cfg = load_config(draft)
    assert (cfg.hidden_size, cfg.num_target_layers, cfg.vocab_size, cfg.num_attention_heads) == (64, 4, 256, 4)
    assert check(["--target", str(out), "--draft", str(draft)]) == 0
    assert "MISMATCH" not in capsys.readouterr().out


def test_data_hf_backend_and_context_read_the_text_model(mm):
    """data.regenerate --backend hf generates with the text model; its context comes from text_config."""
    from data.generate import load_generator
    from data.regenerate import model_context

    out, ids, logits, _ = mm
    gen = load_generator("hf", str(out), None, stop_ids=[1], pad_id=0, device="cpu", dtype="fp32")
    assert type(gen.model).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        assert (gen.model(input_ids=ids[None]).logits[0] - logits).abs().max() < 1e-5
    assert model_context(str(out), None) == 512


def test_other_multimodal_configs_refused(tmp_path, capsys):
    """A multimodal config whose text model DSpine does not run (here Qwen3.5-MoE) is refused by name from the
    config alone, by the reference path, dspine.init and the engine."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    from dspine.init import main as init
    from infer.model import EngineTarget

    cfg = Qwen3_5MoeConfig(text_config={"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 256})
    msg = ("multimodal model_type='qwen3_5_moe' with text_config model_type='qwen3_5_moe_text' is not supported "
           "(DSpine runs the text model of the multimodal model types: qwen3_5 with qwen3_5_text)")
    assert unsupported_layers(cfg) == unsupported_layers(cfg, engine=False) == [msg]
    assert unsupported_layers({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3"}}) == [
        msg.replace("qwen3_5_moe'", "qwen3_5'").replace("'qwen3_5_moe_text'", "'qwen3'")]
    assert unsupported_layers(_config(False)) == []
    cfg.save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match="model_type='qwen3_5_moe'"):
        load_target(str(tmp_path / "moe"))
    with pytest.raises(ValueError, match="model_type='qwen3_5_moe'"):
        EngineTarget.from_pretrained(str(tmp_path / "moe"), device="cpu", dtype=torch.float32, impl="torch")
    assert init(["--target", str(tmp_path / "moe"), "--out", str(tmp_path / "new")]) == 2
    assert "model_type='qwen3_5_moe'" in capsys.readouterr().err and not (tmp_path / "new").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
