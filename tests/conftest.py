"""Shared fixtures. Real data and models come from ``$DSPINE_SHARED`` (default ``<repo>/../shared``)."""

from __future__ import annotations

import tests.kernel_env  # noqa: F401,I001  (sets TRITON_INTERPRET before any kernel import)

import contextlib
import copy
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(1)  # one intra-op thread per xdist worker: two workers on two cores, no oversubscription
SHARED = Path(os.environ.get("DSPINE_SHARED", REPO.parent / "shared"))
POISON = os.environ.get("DSPINE_TEST_POISON", "auto")
if POISON not in ("auto", "0", "1"):
    raise ValueError(f"DSPINE_TEST_POISON={POISON!r}: use 0, 1 or auto")
if POISON == "1" or (POISON == "auto" and not torch.cuda.is_available()):
    # every torch.empty comes back NaN (floats) or the dtype's max (ints), so a read of memory nobody wrote fails
    # every time instead of when the allocator happens to hand out a NaN (CI once failed that way). torch turns the
    # fill on with its deterministic mode; warn_only keeps ops without a deterministic variant running. On by
    # default on the CPU (same run time); on a GPU only with DSPINE_TEST_POISON=1 (deterministic mode changes
    # cuBLAS and scatter choices there); DSPINE_TEST_POISON=0 turns it off.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared asset missing: {p} (set DSPINE_SHARED)")
    return p


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return shared_path("models", "stories260K", "hf")


@pytest.fixture(scope="module")
def stories(stories_dir, tmp_path_factory):
    """(target, draft, folder): the stories260K target (fp32 TargetAdapter), an untrained block-8 draft with
    non-zero injection gates (tests.helpers.random_draft, mask token 0) and that draft saved to a folder. One per
    test module; a module may override it with its own variant."""
    from dspine.checkpoint import save_draft
    from dspine.target import load_target
    from tests.helpers import random_draft

    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=8, mask=0)
    return target, draft, save_draft(draft, tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return shared_path("models", "qwen3-tokenizer")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    """A tiny random Qwen3 (real Qwen3 vocab 151,936 and tokenizer) saved as an HF folder."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_theta=1e6, tie_word_embeddings=False, eos_token_id=151645, pad_token_id=151643,
        bos_token_id=None, initializer_range=0.1,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir).save_pretrained(out)
    return out


_GGUF_PARSES: dict = {}


@contextlib.contextmanager
def gguf_parse_memo():
    """transformers parses a GGUF file at every config, tokenizer and model load from it. Metadata-only parses
    are memoised by the library itself (dspine.gguf_file.memo_gguf_metadata, turned on here); within this context
    a parse *with the tensors* (file, size, mtime, model class, dtype) also runs once per process and later ones
    get a deep copy of its result: the same values the parse returns, as when the file is read again."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from dspine.gguf_file import memo_gguf_metadata

    memo_gguf_metadata()
    real = gguf_utils.load_gguf_checkpoint

    def memo(path, return_tensors=False, model_to_load=None, torch_dtype=None):
        if not return_tensors:
            return real(path, return_tensors=False, model_to_load=model_to_load, torch_dtype=torch_dtype)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, type(model_to_load).__qualname__, torch_dtype)
        if key not in _GGUF_PARSES:
            _GGUF_PARSES[key] = real(path, return_tensors=True, model_to_load=model_to_load, torch_dtype=torch_dtype)
        return copy.deepcopy(_GGUF_PARSES[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_utils, "load_gguf_checkpoint", memo)
        yield


@pytest.fixture
def gguf_memo():
    """:func:`gguf_parse_memo` for one test."""
    with gguf_parse_memo():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
