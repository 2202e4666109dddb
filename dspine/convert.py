"""``python -m dspine.convert --target FILE.gguf --out DIR [--dtype bf16]``

Writes a plain Hugging Face folder (config.json, safetensors weights, tokenizer, generation
config) from a GGUF file, dequantized by transformers. Loading that folder takes a second instead
of re-dequantizing the GGUF every time (the trainer, the engine and the data tools all take it).
Refuses to overwrite an existing non-empty folder. The folder is written as DIR.partial and renamed to DIR when
whole, so a killed conversion never leaves a DIR that looks finished.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch


def convert(target: str, out: str | Path, dtype: str = "bf16", gguf_file: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    from dspine.io import default_file_mode
    from dspine.paths import load_tokenizer, resolve_model_path
    from dspine.target import _parse_dtype

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is an existing file; give a new or empty folder")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; refusing to overwrite")
    path, gguf = resolve_model_path(target, gguf_file)
    if not gguf:
        raise ValueError(f"{target}: not a .gguf file (give --gguf-file for a folder holding one)")
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32)
    model.config.quantization_config = None
    del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model = model.to(_parse_dtype(dtype))
    tmp = out.with_name(out.name + ".partial")  # a killed conversion leaves this, never a half-written --out
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(path, gguf).save_pretrained(tmp)
    for f in tmp.glob("*.safetensors"):
        default_file_mode(f)
    os.replace(tmp, out)  # an empty --out folder is replaced whole
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspine.convert", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help=".gguf file (or folder with --gguf-file)")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args(argv)
    try:
        out = convert(args.target, args.out, args.dtype, args.gguf_file)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
