"""The target's last layer as a draft feature: DFlash's convention (post-norm, HF hidden_states[L]),
recorded in the draft config, the same in the trainer/reference adapter and the engine."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_rope import tiny_target

LAYERS = 3  # tiny_target's depth: layer 2 is the last


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("llf") / "qwen3", "qwen3")


def _ids():
    return torch.tensor([[0, 5, 9, 17, 33, 64, 100, 7, 3, 12]])


@pytest.mark.parametrize("layer_ids", [[0, LAYERS - 1], [LAYERS - 1], [0, 1]])
def test_adapter_features_equal_hf_hidden_states_post_norm(target_dir, layer_ids):
    from dspine.target import final_norm, load_target

    target = load_target(str(target_dir), dtype="fp32", layer_ids=layer_ids)
    ids = _ids()
    hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)  # DFlash/SGLang: hidden_states[i + 1] for every id
    assert torch.equal(target.features(ids), want)
    assert torch.equal(target(ids).features, want)
    # "pre_norm" (older DSpine drafts): the raw output of the last decoder layer instead
    target.set_layer_ids(layer_ids, "pre_norm")
    pre = target.features(ids)
    assert torch.equal(target(ids).features, pre)
    H = target.hidden_size
    for k, i in enumerate(layer_ids):
        got = pre[..., k * H : (k + 1) * H]
        if i == LAYERS - 1:
            assert not torch.allclose(got, hs[i + 1]) and torch.equal(final_norm(target.model)(got), hs[i + 1])
        else:
            assert torch.equal(got, hs[i + 1])


@pytest.mark.parametrize("convention", ["post_norm", "pre_norm"])
@pytest.mark.parametrize("layer_ids", [[0, LAYERS - 1], [LAYERS - 1, 1, 0], [1, 1, 0]], ids=str)
def test_engine_features_equal_the_adapter(target_dir, convention, layer_ids):
    """The engine writes a layer's output into its column block from the next layer's fused norm (the last
    layer's by an add): any order, the last layer (either convention) and a repeated id equal the adapter's."""
    from dspine.target import load_target
    from infer.model import EngineTarget

    ref = load_target(str(target_dir), dtype="fp32")
    ref.set_layer_ids(layer_ids, convention)
    eng = EngineTarget.from_pretrained(str(target_dir), device="cpu", dtype=torch.float32, layer_ids=layer_ids,
                                       impl="torch", last_layer_features=convention)
    ids = _ids()
    want = ref.features(ids)[0]
    P = ids.shape[1]
    cache = eng.new_cache(1, 64)
    _, prefill = eng.prefill(ids[0], 0, cache)
    torch.testing.assert_close(prefill, want, rtol=1e-5, atol=1e-5)
    # a decode step over the cached prefix gives the features of the next positions
    nxt = torch.tensor([[4, 8]])
    _, step = eng.forward_step(nxt, torch.tensor([[P, P + 1]]), cache, torch.tensor([P], dtype=torch.int32))
    full = ref.features(torch.cat([ids, nxt], dim=1))[0, P:]
    torch.testing.assert_close(step[0], full, rtol=1e-5, atol=1e-5)


def test_engine_feature_layer_out_of_range_raises(target_dir):
    from infer.model import EngineTarget

    for bad in ([LAYERS], [-1], [0, LAYERS + 4]):
        eng = EngineTarget.from_pretrained(str(target_dir), device="cpu", dtype=torch.float32, layer_ids=bad,
                                           impl="torch")
        with pytest.raises(ValueError, match="outside the target's layers"):
            eng.prefill(_ids()[0], 0, eng.new_cache(1, 64))


def test_config_records_the_convention_and_reads_old_files(tmp_path):
    from dspine.checkpoint import load_config, save_draft
    from dspine.model import DSpineDraftModel
    from tests.test_config_checkpoint import small_config

    new = small_config()
    assert new.last_layer_features == "post_norm"
    save_draft(DSpineDraftModel(new), tmp_path / "new")
    raw = json.loads((tmp_path / "new" / "config.json").read_text())
    assert raw["dspine_config"]["last_layer_features"] == "post_norm" and load_config(tmp_path / "new").last_layer_features == "post_norm"
    # a DFlash checkpoint (no dspine_config): DFlash's semantics
    dflash = {k: v for k, v in raw.items() if k != "dspine_config"}
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "config.json").write_text(json.dumps(dflash))
    assert load_config(tmp_path / "dflash").last_layer_features == "post_norm"
    # a DSpine draft written before the field existed: what it was trained with
    old = {**raw, "dspine_config": {k: v for k, v in raw["dspine_config"].items() if k != "last_layer_features"}}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    assert load_config(tmp_path / "old").last_layer_features == "pre_norm"
    with pytest.raises(ValueError, match="last_layer_features='mid'"):
        small_config(dspine_config={"last_layer_features": "mid"})


def test_reference_decoder_and_check_use_the_drafts_convention(target_dir, tmp_path, capsys):
    from dspine import check as check_cli
    from dspine import init as init_cli
    from dspine.checkpoint import load_draft
    from dspine.reference import ReferenceDecoder
    from dspine.target import load_target

    draft = tmp_path / "draft"
    assert init_cli.main(["--target", str(target_dir), "--out", str(draft), "--layers", "2", "--target-layer-ids",
                          f"0,{LAYERS - 1}", "--mask-token-id", "5", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert check_cli.main(["--target", str(target_dir), "--draft", str(draft)]) == 0
    out = capsys.readouterr().out
    assert "last-layer features post_norm" in out and "read after the final norm (HF hidden_states[3]" in out
    target = load_target(str(target_dir), dtype="fp32")
    model = load_draft(draft)
    model.config.dspine_config["last_layer_features"] = "pre_norm"
    ReferenceDecoder(target, model, [1])
    assert target.last_layer_features == "pre_norm"
