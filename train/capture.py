"""Offline target features: ``python -m train.capture --config FILE [key=value ...] --out DIR``.

Runs the frozen target once over the training rows (truncated to ``max_length``) and writes the
features of ``target_layer_ids`` to safetensors shards, so a training run with
``feature_source: DIR`` needs no target forward. Layout of DIR:

* ``manifest.json`` — ``format``, target id and revision (when known), target dtype, layer ids,
  the last-layer convention (``last_layer_features``, see ``dspine.config``), hidden size, max length, the data's path/digest and tokenization metadata (tokenizer, chat
  template digest, thinking mode, when the rows come from a ``data.tokenize`` cache), number of
  rows and tokens, the shard list and ``complete``;
* ``shard-NNNNN.safetensors`` — rows ``[start, end)`` back to back: ``features [T, k·H]`` (target
  dtype), ``input_ids [T]`` int32, ``loss_mask [T]`` int8, ``offsets [rows + 1]`` int64.

Before starting it prints the disk estimate ``rows × tokens × k·H × bytes`` and refuses when the
disk has less room. A shard is written to a temporary name and renamed when complete, so a
re-run skips finished shards without rewriting them (docs/method.md §8.12); a re-run with settings
that differ from the manifest is refused, naming the field.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from dspine.io import atomic_write_json
from dspine.paths import load_tokenizer, read_json_object
from train.config import ConfigError, draft_config, parse_cli, resolve_device_settings
from train.data import FORMAT, check_manifest, open_sources

# Manifest fields that must agree between a capture and the run reading it (docs/method.md §4).
IDENTITY = ("format", "target", "target_dtype", "layer_ids", "last_layer_features", "hidden_size", "max_length",
            "data_digest", "num_rows", "rows_per_shard")


def capture(cfg, out: str | Path, rows_per_shard: int = 1024, device: str | None = None) -> Path:
    """Write (or finish) the capture of ``cfg.train`` (one source or several, captured as their union in
    order) into ``out``; returns the folder.

    Raises:
        FileNotFoundError: a ``train`` path with nothing usable (named).
        ValueError: an existing manifest disagrees with this config (names the field), the disk
            estimate exceeds the free space, or a bad ``train`` list (:func:`train.data.open_sources`).
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    from dspine.target import load_target

    out = Path(out)
    if out.exists() and not out.is_dir():  # before the target loads
        raise ValueError(f"--out {out} is a file, expected a folder")
    rows = open_sources(cfg.train)  # one path or a comma-separated list (train.data.split_sources)
    meta = rows.metadata()
    cuda = torch.cuda.is_available()
    dev = resolve_device_settings(cfg, cuda)
    device = device or ("cuda" if cuda else "cpu")
    target = load_target(cfg.target, dtype=dev["target_dtype"], device=device)
    try:
        tokenizer = load_tokenizer(cfg.target)
    except (OSError, ValueError):
        tokenizer = None
    dcfg = draft_config(cfg, target, tokenizer)
    target.set_layer_ids(dcfg.target_layer_ids, dcfg.last_layer_features)

    lengths = [min(len(rows.row(i)["input_ids"]), cfg.max_length) for i in range(len(rows))]
    kH = len(dcfg.target_layer_ids) * target.hidden_size
    nbytes = torch.empty(0, dtype=target.dtype).element_size()
    tokens = sum(lengths)
    estimate = tokens * kH * nbytes
    print(f"disk estimate: {len(rows)} rows x {tokens / max(len(rows), 1):.1f} tokens x {kH} (k*H) x {nbytes} bytes "
          f"= {estimate / 2**30:.3f} GiB (+ ids/masks {tokens * 5 / 2**20:.1f} MiB)", flush=True)
    shards = [{"file": f"shard-{j:05d}.safetensors", "start": s, "end": min(s + rows_per_shard, len(rows)),
               "tokens": sum(lengths[s: s + rows_per_shard])}
              for j, s in enumerate(range(0, len(rows), rows_per_shard))]
    manifest = {
        "format": FORMAT, "target": cfg.target, "target_revision": getattr(target.config, "_commit_hash", None),
        "target_dtype": dev["target_dtype"], "layer_ids": list(dcfg.target_layer_ids),
        "last_layer_features": dcfg.last_layer_features,
        "hidden_size": target.hidden_size, "feature_dim": kH, "max_length": cfg.max_length, **meta,
        "num_rows": len(rows), "total_tokens": tokens, "rows_per_shard": rows_per_shard, "shards": shards,
        "complete": False,
    }
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / "manifest.json"
    if not mpath.is_file() and any(out.glob("shard-*.safetensors")):
        raise ValueError(f"{out}: holds shard-*.safetensors but no manifest.json, so which capture wrote them cannot "
                         "be checked; move them away or delete them")
    if mpath.is_file():
        check_manifest(read_json_object(mpath, "a train.capture manifest"), {k: manifest[k] for k in IDENTITY}, str(out))
    todo = [s for s in shards if not (out / s["file"]).is_file()]
    need = sum(s["tokens"] for s in todo) * (kH * nbytes + 5)
    free = shutil.disk_usage(out).free
    if need > free:
        raise ValueError(f"{out}: the capture needs {need / 2**30:.2f} GiB more but only {free / 2**30:.2f} GiB are free")
    atomic_write_json(mpath, manifest)
    print(f"{len(shards) - len(todo)} of {len(shards)} shards already complete", flush=True)

    with torch.no_grad():
        for s in tqdm(todo, desc="capture shards"):
            feats, ids, masks, offsets = [], [], [], [0]
            for b in range(s["start"], s["end"], cfg.micro_batch_size):
                batch = [rows.row(i) for i in range(b, min(b + cfg.micro_batch_size, s["end"]))]
                seqs = [r["input_ids"][: cfg.max_length] for r in batch]
                S = max(len(x) for x in seqs)
                input_ids = torch.zeros(len(seqs), S, dtype=torch.long)
                attn = torch.zeros(len(seqs), S, dtype=torch.long)
                for i, x in enumerate(seqs):
                    input_ids[i, : len(x)] = torch.tensor(x)
                    attn[i, : len(x)] = 1
                f = target.features(input_ids.to(device), attn.to(device) if bool((attn == 0).any()) else None)
                for i, (r, x) in enumerate(zip(batch, seqs)):
                    feats.append(f[i, : len(x)].cpu())
                    ids.append(torch.tensor(x, dtype=torch.int32))
                    masks.append(torch.tensor(r["loss_mask"][: cfg.max_length], dtype=torch.int8))
                    offsets.append(offsets[-1] + len(x))
            tmp = out / (s["file"] + ".tmp")
            save_file({"features": torch.cat(feats).contiguous(), "input_ids": torch.cat(ids),
                       "loss_mask": torch.cat(masks), "offsets": torch.tensor(offsets, dtype=torch.int64)},
                      str(tmp), metadata={"start": str(s["start"]), "end": str(s["end"])})
            os.replace(tmp, out / s["file"])
    manifest["complete"] = True
    atomic_write_json(mpath, manifest)
    print(f"wrote {out}: {len(rows)} rows, {tokens} tokens, {len(shards)} shards", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, flags = parse_cli(sys.argv[1:] if argv is None else argv, "python -m train.capture",
                               extra_flags=("--out", "--rows-per-shard"))
        if "--out" not in flags:
            raise ConfigError("--out DIR is required")
        text = flags.get("--rows-per-shard", "1024")
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"--rows-per-shard {text}: expected a whole number of rows, at least 1")
        capture(cfg, flags["--out"], int(text))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
