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

import bisect
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from dspine.paths import read_json_object

FORMAT = "dspine-features-v1"
# Manifest fields that must agree between a capture and the run reading it (docs/method.md §4).
IDENTITY = ("format", "target", "target_dtype", "layer_ids", "last_layer_features", "hidden_size", "max_length",
            "data_digest", "num_rows", "rows_per_shard")


def last_layer_features(dcfg, num_target_layers: int) -> str | None:
    """The draft's last-layer convention when its features include the target's last layer, else None
    (then both conventions give the same features)."""
    return dcfg.last_layer_features if num_target_layers - 1 in dcfg.target_layer_ids else None


def expected_fields(cfg, target_dtype: str, layer_ids: list[int], data_digest: str | None = None,
                    last_layer: str | None = None) -> dict:
    """The manifest fields a run with config ``cfg`` requires from a capture (``last_layer``: see
    :func:`last_layer_features`; a capture made before the field existed has none and is refused then)."""
    want = {"format": FORMAT, "target": cfg.target, "target_dtype": target_dtype, "layer_ids": list(layer_ids),
            "max_length": cfg.max_length}
    if data_digest is not None:
        want["data_digest"] = data_digest
    if last_layer is not None:
        want["last_layer_features"] = last_layer
    return want


def check_manifest(manifest: dict, expected: dict, where: str) -> None:
    """Raise ValueError naming the first field whose value differs from ``expected``."""
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise ValueError(f"{where}: manifest field {key!r} is {manifest.get(key)!r} but the run config needs "
                             f"{value!r}; capture again for this config (another --out) or fix the config")


class CaptureRows:
    """Row source over a capture folder: ``row(i)`` -> input_ids, loss_mask (lists) and ``features [L, k·H]``.

    Raises:
        ValueError: the capture is incomplete (a capture run has not finished) or not this format.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = read_json_object(self.folder / "manifest.json", "a train.capture manifest")
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.folder}: manifest format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        if not self.manifest.get("complete"):
            raise ValueError(f"{self.folder}: capture is incomplete; run `python -m train.capture` again to finish it")
        self.shards = self.manifest["shards"]
        self.starts = [s["start"] for s in self.shards]
        self._open: dict[int, tuple] = {}

    def __len__(self) -> int:
        return int(self.manifest["num_rows"])

    def check(self, expected: dict) -> None:
        check_manifest(self.manifest, expected, str(self.folder))

    def _shard(self, j: int):
        if j not in self._open:
            from safetensors import safe_open

            fh = safe_open(str(self.folder / self.shards[j]["file"]), framework="pt")
            self._open[j] = (fh, fh.get_tensor("offsets").tolist())
        return self._open[j]

    def row(self, i: int) -> dict:
        j = bisect.bisect_right(self.starts, i) - 1
        fh, offsets = self._shard(j)
        a, b = offsets[i - self.starts[j]], offsets[i - self.starts[j] + 1]
        return {"input_ids": fh.get_slice("input_ids")[a:b].long().tolist(),
                "loss_mask": fh.get_slice("loss_mask")[a:b].long().tolist(),
                "features": fh.get_slice("features")[a:b]}

    def metadata(self) -> dict:
        return {k: self.manifest.get(k) for k in ("data", "data_digest", "tokenizer", "chat_template_digest", "thinking")}


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def capture(cfg, out: str | Path, rows_per_shard: int = 1024, device: str | None = None) -> Path:
    """Write (or finish) the capture of ``cfg.train`` into ``out``; returns the folder.

    Raises:
        ValueError: an existing manifest disagrees with this config (names the field), or the
            disk estimate exceeds the free space.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    from dspine.target import load_target, load_tokenizer
    from train.config import draft_config, resolve_device_settings
    from train.data import open_rows

    out = Path(out)
    rows = open_rows(cfg.train)
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
    if mpath.is_file():
        check_manifest(read_json_object(mpath, "a train.capture manifest"), {k: manifest[k] for k in IDENTITY}, str(out))
    todo = [s for s in shards if not (out / s["file"]).is_file()]
    need = sum(s["tokens"] for s in todo) * (kH * nbytes + 5)
    free = shutil.disk_usage(out).free
    if need > free:
        raise ValueError(f"{out}: the capture needs {need / 2**30:.2f} GiB more but only {free / 2**30:.2f} GiB are free")
    _atomic_json(mpath, manifest)
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
    _atomic_json(mpath, manifest)
    print(f"wrote {out}: {len(rows)} rows, {tokens} tokens, {len(shards)} shards", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from train.config import ConfigError, parse_cli

    try:
        cfg, flags = parse_cli(sys.argv[1:] if argv is None else argv, "python -m train.capture",
                               extra_flags=("--out", "--rows-per-shard"))
        if "--out" not in flags:
            raise ConfigError("--out DIR is required")
        rows_per_shard = int(flags.get("--rows-per-shard", 1024))
        capture(cfg, flags["--out"], rows_per_shard)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
