"""Generation backends for regenerating assistant turns with the target.

A backend is anything with the `Generator.generate` method. Two exist:

- `hf`: transformers `generate` (reference path; CPU or GPU).
- `engine`: the inference engine of `infer.engine` (`load_engine(...)` and
  `Engine.generate(prompts, SamplingParams, use_draft=False)`), run autoregressively: CUDA graphs
  on a GPU, PyTorch reference kernels on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from dspine.sampling import SamplingParams
from infer.engine import load_engine

BACKENDS = ("auto", "hf", "engine")


class Generation(NamedTuple):
    """One generated answer: `token_ids` without the stop token; `finish_reason` "stop" iff a stop
    token was generated, "length" if max_new_tokens ran out first."""

    token_ids: list[int]
    finish_reason: str


class Generator(Protocol):
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
    ) -> list[Generation]:
        """Continues each prompt (token ids). temperature 0 = greedy; top_k 0 and top_p 1 = off.
        Returns one `Generation` per prompt, in order."""
        ...


class HFGenerator:
    """`Generator` over a transformers causal LM: left-padded batches through `model.generate`.

    Args:
        model: a `PreTrainedModel` with a language-model head, already on its device.
        stop_token_ids: ids that end an answer (see `data.chat.stop_token_ids`).
        pad_token_id: id used for left padding (masked out by the attention mask).
    """

    def __init__(self, model, stop_token_ids: list[int], pad_token_id: int):
        if not stop_token_ids:
            raise ValueError("HFGenerator needs at least one stop token id")
        self.model = model
        self.stop_token_ids = list(stop_token_ids)
        self.pad_token_id = pad_token_id

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, temperature, top_p, top_k, seed) -> list[Generation]:
        from transformers import GenerationConfig

        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        sample = temperature > 0
        # A fresh config, so nothing from the checkpoint's generation_config (Qwen3 ships
        # do_sample/temperature/top_k defaults) changes the requested decoding.
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            **({"temperature": temperature, "top_p": top_p, "top_k": top_k} if sample else {}),
        )
        if sample:
            torch.manual_seed(seed)
        device = self.model.device
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        results = []
        stops = set(self.stop_token_ids)
        for row in out[:, width:].tolist():
            end = next((j for j, t in enumerate(row) if t in stops), None)
            results.append(Generation(row, "length") if end is None else Generation(row[:end], "stop"))
        return results


class EngineGenerator:
    """`Generator` over an `infer.engine.Engine`, decoding autoregressively (no draft).

    The engine keeps the stop token at the end of a finished row; it is dropped here so both
    backends return the same thing.
    """

    def __init__(self, engine):
        self.engine = engine
        self.profile: dict[str, float] = {}  # engine.loop_profile summed over the generate calls

    def generate(self, prompts, max_new_tokens, temperature, top_p, top_k, seed) -> list[Generation]:
        if not prompts:
            return []
        params = SamplingParams(temperature, top_p, top_k, max_new_tokens, seed)
        res = self.engine.generate(prompts, params, use_draft=False)
        for key, value in self.engine.loop_profile.items():
            self.profile[key] = self.profile.get(key, 0) + value
        self.profile["calls"] = self.profile.get("calls", 0) + 1
        return [
            Generation(toks[:-1], "stop") if reason == "stop" else Generation(toks, "length")
            for toks, reason in zip(res.token_ids, res.finish_reasons)
        ]


def format_profile(profile: dict) -> str:
    """One line from ``EngineGenerator.profile``: tokens/s inside generate, steps, and ms per step of the
    decode loop's parts (``infer.engine.Engine.loop_profile``)."""
    steps = max(profile.get("steps", 0), 1)
    wall = profile.get("wall_s", 0.0)
    per = lambda key: profile.get(key, 0.0) / steps * 1e3  # noqa: E731
    return (f"engine loop: {profile.get('calls', 0)} calls, {profile.get('tokens', 0)} tokens in {wall:.1f} s "
            f"({profile.get('tokens', 0) / wall if wall else 0:.0f} tok/s), {profile.get('steps', 0)} steps, "
            f"{wall / steps * 1e3:.2f} ms/step = launch {per('launch_s'):.2f} + wait for device {per('wait_s'):.2f} "
            f"+ host {per('host_s'):.2f} + admission/prefill {per('prefill_s'):.2f} ms/step (+ rest)")


def resolve_backend(name: str) -> str:
    """Maps "auto" to "engine" when CUDA is available, else "hf".

    Raises:
        ValueError: unknown backend name.
    """
    if name not in BACKENDS:
        raise ValueError(f"--backend {name!r}: expected one of {BACKENDS}")
    if name == "auto":
        return "engine" if torch.cuda.is_available() else "hf"
    return name


def load_generator(
    backend: str,
    target: str,
    gguf_file: str | None,
    stop_ids: list[int],
    pad_id: int,
    device,
    max_batch: int = 16,
    max_context: int | None = None,
    dtype: str = "auto",
) -> Generator:
    """Builds the generator of a resolved backend ("hf" or "engine") for the target checkpoint.

    hf loads `AutoModelForCausalLM` (bf16 on CUDA, fp32 + eager attention on CPU) from a folder, Hub id
    or GGUF file. engine preallocates KV caches for `max_batch` rows of `max_context` tokens (prompt +
    new tokens; default 4096), so keep max_context near what the data needs.
    """
    cuda = torch.device(device).type == "cuda"
    if dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: expected auto, bf16 or fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype, torch.bfloat16 if cuda else torch.float32)
    if backend == "engine":
        engine, _ = load_engine(
            target,
            gguf_file,
            None,
            device=device,
            dtype=dtype,
            max_batch=max_batch,
            max_seq=max_context or 4096,
            eos_token_ids=stop_ids,
        )
        return EngineGenerator(engine)
    from transformers import AutoConfig, AutoModelForCausalLM

    from dspine.config import is_multimodal
    from dspine.target import load_text_model

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if not cuda:
        # CPU SDPA has a large fixed cost per call in recent torch builds (stories260K: ~10x slower
        # generation than eager); the math is the same.
        kwargs["attn_implementation"] = "eager"
    if not gguf_file and is_multimodal(config := AutoConfig.from_pretrained(target)):  # qwen3_5: its text model
        model = load_text_model(target, config, dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, **kwargs)
    model = model.to(device).eval()
    return HFGenerator(model, stop_ids, pad_id)
