"""The DSpine draft shipped for SmolLM2-135M-Instruct (the README's main command) on the CPU."""

from __future__ import annotations

import pytest
import torch

from dspine.sampling import SamplingParams
from infer.generate import DEFAULT_DRAFT, DEFAULT_TARGET

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    if not DEFAULT_TARGET.is_file():
        pytest.skip(f"{DEFAULT_TARGET} missing: run `python -m infer.fetch` (the README's commands do)")
    from dspine.checkpoint import load_draft
    from dspine.paths import load_tokenizer
    from dspine.target import TargetSpec, assert_compatible, load_target
    from tests.conftest import gguf_parse_memo

    with gguf_parse_memo():  # the config, model and tokenizer loads parse the GGUF's metadata once
        target = load_target(str(DEFAULT_TARGET), dtype="fp32")
        tok = load_tokenizer(str(DEFAULT_TARGET))
    draft = load_draft(DEFAULT_DRAFT, dtype=torch.float32)
    spec = TargetSpec.from_adapter(target, tok)
    assert_compatible(spec, draft.config, max_context=2048)
    return target, tok, draft, sorted(spec.eos_ids)


def test_shipped_draft_size_and_layout():
    from safetensors import safe_open

    path = DEFAULT_DRAFT / "model.safetensors"
    assert path.stat().st_size <= 25_000_000  # ships in the repo
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
    assert "fc.weight" in names and not any("embed" in n or "lm_head" in n for n in names)


def test_shipped_draft_holds_no_machine_paths():
    """Its metadata (config.json, the safetensors header) names no absolute path of the machine that built it."""
    import json

    from safetensors import safe_open

    with safe_open(str(DEFAULT_DRAFT / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    values = [*meta.values(), *(json.dumps(json.loads(p.read_text())) for p in DEFAULT_DRAFT.glob("*.json"))]
    assert not [v for v in values if v.startswith("/") or '"/' in v or "/work/" in v or "/home/" in v], meta
    assert meta["target"] == "runs/smollm2/smollm2-hf"  # as in scripts/smollm2/recipe.sh, which made it


def test_shipped_draft_greedy_equals_ar_and_accepts(smollm2):
    from dspine.prompts import encode_prompt
    from dspine.reference import ReferenceDecoder
    from infer.datasets import load_eval_prompts

    target, tok, draft, eos = smollm2
    chats = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "Give me three tips for better sleep."]
    prompts = [encode_prompt(tok, t) for t in chats]
    p = SamplingParams(max_new_tokens=40)
    spec = ReferenceDecoder(target, draft, eos).generate(prompts, p)
    ar = ReferenceDecoder(target, None, eos).generate(prompts, p)
    assert spec.token_ids == ar.token_ids
    try:
        gsm = [encode_prompt(tok, x.turns[0]) for x in load_eval_prompts("gsm8k", 3)]
    except FileNotFoundError as e:
        pytest.skip(f"GSM8K prompts unavailable: {e}")
    res = ReferenceDecoder(target, draft, eos).generate(gsm, SamplingParams(max_new_tokens=64))
    # The shipped draft is the GPU recipe's DSpine draft trained further four times (README, continuation tables);
    # it measures tau = 2.70 and accept_at_pos[0] = 0.61 here (x86_64, fp32; 3.20 mean tau over five tasks on the
    # H200; the third continuation's draft measured the same 2.70 and 0.61 here: with 3 verified slots the two
    # agree on these prompts; the second continuation's: 2.625 and 0.61). The floors catch a broken,
    # untrained or wrongly loaded draft, the drafts shipped before the second continuation (the first's: 2.30 and
    # 0.61 here; the recipe's: 2.20 and 0.52; the CPU-made one 1.32), and regressions in the decoder.
    assert res.stats.tau > 2.55, res.stats.to_dict()
    assert res.stats.accept_at_pos[0] > 0.57, res.stats.to_dict()
    assert abs(res.stats.tau - 1 - sum(res.stats.accept_at_pos)) < 1e-12
