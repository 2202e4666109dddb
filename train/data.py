"""Training rows: readers, the per-epoch order, the rank split and micro-batch collation.

A row source is anything with ``len()`` and ``row(i) -> {"input_ids", "loss_mask"[, "features"]}``
(the ``data.tokenize`` contract, docs/contracts.md). Three are provided: a JSON-lines file
(:class:`JsonlRows`), a ``data.tokenize`` cache folder (:class:`ArrowRows`) and a ``train.capture``
folder with target features (:class:`CaptureRows`, written by ``train.capture``). :func:`open_rows` picks one.
The run config's ``train`` key may name several ``.jsonl`` files / cache folders separated by commas
(``train=/a/cache1,/b/cache2``, e.g. two ``data.pack`` imports of different regeneration runs):
:func:`open_sources` then returns their union in that order (:class:`ConcatRows`; its data digest
depends on the order), and one path opens exactly as :func:`open_rows` does.

Order: optimizer step s of a run reads the global batch ``perm_e[i : i + G]`` with
``G = micro_batch_size · grad_accum · world``, e = s // steps_per_epoch, i = (s mod steps_per_epoch)·G
and ``perm_e`` a permutation seeded by (seed, e); rank r takes items r::world of it, so the ranks
see disjoint rows and a resumed run reads exactly what the uninterrupted run would have.

Anchors: micro-batch m of rank r draws them from ``anchor_generator(seed, s, 0, m·world + r)``. With
``micro_batch_size = 1`` that index is the position of its row in the global batch, so a run on W ranks
with grad_accum A and one on 1 rank with grad_accum W·A train on the same rows with the same anchors
(the two-GPU loss-curve check); on one rank it is the plain micro-batch index.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dspine.io import file_digest
from dspine.paths import read_json_object
from train.loss import anchor_generator, block_input_ids, block_targets, sample_anchors


class JsonlRows:
    """Rows of a ``.jsonl`` file, read on demand through a byte-offset index (no file-size copy in memory).

    Every row is checked once at open (:func:`_checked`), so a corrupt row fails before the first step
    instead of when the trainer reaches it; ``max_token`` = (largest token id, ``file:line`` of its row)
    lets the trainer check the target's vocabulary once the target is loaded.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a row that is not a JSON object, or whose ``input_ids`` / ``loss_mask`` are missing,
            not lists of integer ids / 0-1 values, or of different lengths; the message names
            ``file:line`` and the field.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"rows file not found: {self.path}")
        self.offsets, self.lines = [], []  # byte offset and 1-based line number of each non-blank line
        self.max_token: tuple[int, str] | None = None
        top = -1
        digest = hashlib.blake2b(digest_size=16)  # dspine.io.file_digest's, taken in the same pass
        with open(self.path, "rb") as f:
            pos = 0
            for lineno, line in enumerate(f, 1):
                digest.update(line)
                if line.strip():
                    ids = _parsed(line, f"{self.path}:{lineno}")["input_ids"]
                    if ids and max(ids) > top:
                        top = max(ids)
                        self.max_token = (top, f"{self.path}:{lineno}")
                    self.offsets.append(pos)
                    self.lines.append(lineno)
                pos += len(line)
        self._digest = digest.hexdigest()
        self._fh, self._pid = None, None

    def __len__(self) -> int:
        return len(self.offsets)

    def row(self, i: int) -> dict:
        # one handle per process: DataLoader workers are forked, and a handle inherited from the parent
        # shares its file offset with every other worker (seek + readline would race)
        if self._fh is None or self._pid != os.getpid():
            self._fh, self._pid = open(self.path, "rb"), os.getpid()
        self._fh.seek(self.offsets[i])
        return _parsed(self._fh.readline(), f"{self.path}:{self.lines[i]}")

    def metadata(self) -> dict:
        return {"data": str(self.path), "data_digest": self._digest}


class ArrowRows:
    """A ``data.tokenize`` cache folder (``data.arrow`` + ``manifest.json``), memory mapped.

    At open, column-wise Arrow checks (milliseconds for 40k rows) refuse what a row check would find
    later: a missing column, nulls, non-integer ids, negative ids, mask values other than 0/1, and
    ``input_ids`` / ``loss_mask`` of different lengths; ``max_token`` as in :class:`JsonlRows`.

    Raises:
        ValueError: naming ``data.arrow``, the row and the field; naming the folder when it has no
            ``summary.json`` (written last by ``data.tokenize``: a killed or running build); naming
            ``data.arrow`` when it is truncated or corrupt.
    """

    def __init__(self, folder: str | Path):
        import pyarrow as pa
        from datasets import Dataset

        self.folder = Path(folder)
        where = self.folder / "data.arrow"
        if not (self.folder / "summary.json").is_file():
            raise ValueError(f"{self.folder}: unfinished data.tokenize cache (no summary.json, which data.tokenize "
                             "writes last; a killed or still running build); delete it and run data.tokenize again")
        try:
            ds = Dataset.from_file(str(where))
        except (OSError, pa.ArrowException) as e:  # a truncated stream: "Expected to be able to read N bytes ..."
            raise ValueError(f"{where}: truncated or corrupt Arrow file ({e}); delete {self.folder} and run "
                             "data.tokenize again") from None
        for key in ("input_ids", "loss_mask"):
            if key not in ds.column_names:
                raise ValueError(f"{where}: no column {key!r} (columns: {ds.column_names}); not a data.tokenize cache")
        self.ds = ds.select_columns(["input_ids", "loss_mask"])
        self.max_token = _check_arrow(self.ds.data.table, where)
        manifest = self.folder / "manifest.json"
        self.manifest = read_json_object(manifest, "a data.tokenize manifest") if manifest.is_file() else {}

    def __len__(self) -> int:
        return len(self.ds)

    def row(self, i: int) -> dict:
        return _checked(self.ds[int(i)], f"{self.folder / 'data.arrow'} row {i}")

    def metadata(self) -> dict:
        m = self.manifest
        digest = file_digest(self.folder / "manifest.json") if m else file_digest(self.folder / "data.arrow")
        return {"data": str(self.folder), "data_digest": digest, "tokenizer": m.get("tokenizer"),
                "chat_template_digest": m.get("template_digest"), "thinking": m.get("thinking"),
                "tokenized_max_length": m.get("max_length")}


# ------------------------------------------------------------------------------------- captures

FORMAT = "dspine-features-v1"  # manifest format of a train.capture folder


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
        """The manifest against ``expected`` (:func:`check_manifest`) and every shard's header, before training.

        Raises:
            ValueError: a manifest field differs, or a shard is missing, truncated or corrupt (named)."""
        from safetensors import safe_open

        check_manifest(self.manifest, expected, str(self.folder))
        for s in self.shards:
            try:
                with safe_open(str(self.folder / s["file"]), framework="pt") as fh:
                    fh.keys()
            except Exception as e:  # safetensors' SafetensorError or the OS's
                raise ValueError(f"{self.folder / s['file']}: missing, truncated or corrupt capture shard ({e}); run "
                                 "`python -m train.capture` again into a new --out") from None

    def row(self, i: int) -> dict:
        j = bisect.bisect_right(self.starts, i) - 1
        if j not in self._open:
            from safetensors import safe_open

            fh = safe_open(str(self.folder / self.shards[j]["file"]), framework="pt")
            self._open[j] = (fh, fh.get_tensor("offsets").tolist())
        fh, offsets = self._open[j]
        a, b = offsets[i - self.starts[j]], offsets[i - self.starts[j] + 1]
        return {"input_ids": fh.get_slice("input_ids")[a:b].long().tolist(),
                "loss_mask": fh.get_slice("loss_mask")[a:b].long().tolist(),
                "features": fh.get_slice("features")[a:b]}

    def metadata(self) -> dict:
        return {k: self.manifest.get(k) for k in ("data", "data_digest", "tokenizer", "chat_template_digest", "thinking")}


def _parsed(raw: bytes, where: str) -> dict:
    """One ``.jsonl`` line -> its checked row (:func:`_checked`); ``where`` = ``file:line``."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: invalid JSON ({e})") from None
    return _checked(obj, where)


def _checked(obj, where: str) -> dict:
    """``{"input_ids", "loss_mask"}`` of a row, checked: lists of equal length, ids integers >= 0, mask 0/1.

    C-speed checks only (``min``/``sum``/``set`` over each list: a float makes the sum a float, a string or
    a list makes them raise), so a 16M-token file is checked in about a second. Raises ValueError naming
    ``where`` and the field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a JSON {type(obj).__name__}, not an object")
    if "input_ids" not in obj and "conversations" in obj:
        raise ValueError(f"{where} is a conversation, not tokenized rows: run python -m data.tokenize first "
                         "and train on its cache folder")
    for key in ("input_ids", "loss_mask"):
        if obj.get(key) is None:
            raise ValueError(f"{where}: field {key!r} is missing")
        if not isinstance(obj[key], list):
            raise ValueError(f"{where}: field {key!r} is a {type(obj[key]).__name__}, expected a list")
    ids, mask = obj["input_ids"], obj["loss_mask"]
    if len(ids) != len(mask):
        raise ValueError(f"{where}: field 'loss_mask' has {len(mask)} values for {len(ids)} input_ids")
    if ids:
        try:
            low, total = min(ids), sum(ids)
        except TypeError:
            low, total = None, None
        if type(total) is not int:
            bad = next((v for v in ids if type(v) is not int), total)
            raise ValueError(f"{where}: field 'input_ids' holds {bad!r}, expected integer token ids")
        if low < 0:
            raise ValueError(f"{where}: field 'input_ids' holds token id {low} < 0")
        try:
            binary = set(mask) <= {0, 1}
        except TypeError:  # an unhashable value (a list)
            binary = False
        if not binary:
            bad = next(v for v in mask if not isinstance(v, (int, float)) or v not in (0, 1))
            raise ValueError(f"{where}: field 'loss_mask' holds {bad!r}, expected 0 or 1")
    return {"input_ids": ids, "loss_mask": mask}


def _check_arrow(table, where) -> tuple[int, str] | None:
    """Column-wise checks of a ``data.tokenize`` table (``ArrowRows``); returns ``max_token``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    cols = {key: table.column(key) for key in ("input_ids", "loss_mask")}
    lengths = {}
    for key, col in cols.items():
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) \
                or not pa.types.is_integer(col.type.value_type):
            raise ValueError(f"{where}: column {key!r} is {col.type}, expected a list of integers")
        if col.null_count:
            row = int(pc.index(pc.is_null(col), True).as_py())
            raise ValueError(f"{where} row {row}: field {key!r} is missing (null)")
        lengths[key] = pc.list_value_length(col).to_numpy()
    differ = np.flatnonzero(lengths["input_ids"] != lengths["loss_mask"])
    if len(differ):
        row = int(differ[0])
        raise ValueError(f"{where} row {row}: field 'loss_mask' has {lengths['loss_mask'][row]} values for "
                         f"{lengths['input_ids'][row]} input_ids")
    ends = np.cumsum(lengths["input_ids"])
    row_of = lambda flat_index: int(np.searchsorted(ends, flat_index, side="right"))
    ids, mask = pc.list_flatten(cols["input_ids"]), pc.list_flatten(cols["loss_mask"])
    if len(ids) == 0:
        return None
    lo_hi = pc.min_max(ids).as_py()
    if lo_hi["min"] < 0:
        raise ValueError(f"{where} row {row_of(pc.index(ids, lo_hi['min']).as_py())}: field 'input_ids' holds "
                         f"token id {lo_hi['min']} < 0")
    outside = pc.and_(pc.not_equal(mask, 0), pc.not_equal(mask, 1))
    if pc.any(outside).as_py():
        i = pc.index(outside, True).as_py()
        raise ValueError(f"{where} row {row_of(i)}: field 'loss_mask' holds {mask[i].as_py()}, expected 0 or 1")
    return lo_hi["max"], f"{where} row {row_of(pc.index(ids, lo_hi['max']).as_py())}"


def open_rows(path: str | Path):
    """A row source for a ``.jsonl`` file, a ``data.tokenize`` cache folder or a ``train.capture`` folder.

    Raises:
        FileNotFoundError: nothing usable at ``path``.
        ValueError: an unfinished or corrupt cache folder (see :class:`ArrowRows`).
    """
    p = Path(path)
    if p.is_dir() and ((p / "data.arrow").is_file() or ".tmp-" in p.name):  # .tmp-: a data.tokenize build
        return ArrowRows(p)
    if p.is_dir() and (p / "manifest.json").is_file() and str(
            read_json_object(p / "manifest.json", "a manifest").get("format", "")).startswith("dspine-features"):
        return CaptureRows(p)
    if p.is_file():
        return JsonlRows(p)
    raise FileNotFoundError(f"{path}: not a .jsonl file, a data.tokenize cache folder (data.arrow) "
                            "or a train.capture folder (manifest.json)")


def split_sources(spec: str) -> list[str]:
    """The paths of the ``train`` key: ``"a,b"`` -> ``["a", "b"]`` (spaces around an entry dropped);
    a value without a comma is one path, returned unchanged.

    Raises:
        ValueError: an empty entry (``a,,b``, a leading or trailing comma) or an entry given twice
            (``a,./a``: the same resolved path); the message names the value.
    """
    if "," not in spec:
        return [spec]
    parts = [p.strip() for p in spec.split(",")]
    if not all(parts):
        raise ValueError(f"{spec!r}: empty entry in the comma-separated list of sources (a doubled, leading or "
                         "trailing comma?)")
    seen: dict[Path, str] = {}
    for p in parts:
        key = Path(p).expanduser().resolve()
        if key in seen:
            twice = f"{p!r} is listed twice" if seen[key] == p else f"{p!r} is {seen[key]!r} again"
            raise ValueError(f"{spec!r}: {twice}; each source may appear once (its rows would be trained on "
                             "twice per epoch)")
        seen[key] = p
    return parts


class ConcatRows:
    """Several row sources (``.jsonl`` files or ``data.tokenize`` cache folders) read as one, in order.

    Row ``i`` of the union is row ``i - start[j]`` of part ``j``, with ``start`` the cumulative lengths
    (found by bisection); the trainer's :class:`StepOrder` then permutes ``range(len(self))`` as for
    one source, so a resumed run reads exactly what the uninterrupted one would have.
    ``max_token`` = the largest of the parts' (with the ``where`` of that part), None if every part's is None.

    Args:
        paths: the parts in order, each opened with :func:`open_rows` (:func:`open_sources` makes a
            ConcatRows for two or more; duplicates are refused there, by :func:`split_sources`).
    Raises:
        FileNotFoundError / ValueError: from :func:`open_rows` for a part (named there).
        ValueError: no paths; a part that is a ``train.capture`` folder (one capture is a whole
            ``feature_source``, not a part of a union); parts that disagree on ``tokenizer`` (the
            tokenizer files' digest when both parts' manifests record it, else the tokenizer path),
            ``chat_template_digest`` or ``thinking`` (the message names both parts and the field).
    """

    CHECKED = ("tokenizer", "chat_template_digest", "thinking")  # fields every part must share

    def __init__(self, paths: list[str | Path]):
        if not paths:
            raise ValueError("no row sources given")
        self.paths = [str(p) for p in paths]
        self.parts = [open_rows(p) for p in paths]
        for path, part in zip(self.paths, self.parts):
            if isinstance(part, CaptureRows):
                raise ValueError(f"{path} is a train.capture folder, which cannot be one of several train "
                                 "sources; capture the union instead (python -m train.capture with train=<the "
                                 "list>) and give that folder as feature_source")
        self.starts = [0, *itertools.accumulate(map(len, self.parts))]
        self._meta = [part.metadata() for part in self.parts]
        for k in range(1, len(self.parts)):
            for key in self.CHECKED:
                field, a, b = self._compared(0, k, key)
                if a != b:
                    unknown = [self.paths[i] for i, v in ((0, a), (k, b)) if v is None]
                    why = (f" ({', '.join(unknown)} records no {field}: a .jsonl file, or a cache made before "
                           "data.tokenize recorded it)" if unknown else "")
                    raise ValueError(f"train sources {self.paths[0]} and {self.paths[k]} disagree on {field}: {a!r} "
                                     f"vs {b!r}{why}; rows tokenized differently cannot be trained on together")
        tops = [part.max_token for part in self.parts if part.max_token is not None]
        self.max_token: tuple[int, str] | None = max(tops, key=lambda t: t[0]) if tops else None

    def _compared(self, j: int, k: int, key: str) -> tuple[str, object, object]:
        """(field, value of part j, value of part k) for metadata field ``key``. The tokenizer is compared
        by the tokenizer files' digest when both parts' manifests hold one (the same tokenizer saved at
        another path is the same tokenizer), else by its path."""
        if key == "tokenizer":
            digests = [getattr(self.parts[i], "manifest", {}).get("tokenizer_digest") for i in (j, k)]
            if None not in digests:
                return "tokenizer_digest", digests[0], digests[1]
        return key, self._meta[j].get(key), self._meta[k].get(key)

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """(part index, row index inside that part) of row ``i``; raises IndexError outside 0..len-1."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} outside the {len(self)} rows of {','.join(self.paths)}")
        j = bisect.bisect_right(self.starts, i) - 1  # empty parts share a start; bisect_right skips them
        return j, i - self.starts[j]

    def row(self, i: int) -> dict:
        j, k = self.locate(i)
        return self.parts[j].row(k)

    def metadata(self) -> dict:
        """``data`` = the parts' paths joined by commas; ``data_digest`` = sha256 (hex) of the parts'
        digests joined by newlines, in order (another order is another data order, so another digest);
        tokenizer, chat template digest and thinking as the parts share them (the first part's tokenizer
        path); ``tokenized_max_length`` the largest of the parts', None when a part has none (a .jsonl)."""
        digest = hashlib.sha256("\n".join(m["data_digest"] for m in self._meta).encode()).hexdigest()
        lengths = [m.get("tokenized_max_length") for m in self._meta]
        return {"data": ",".join(str(m["data"]) for m in self._meta), "data_digest": digest,
                **{key: self._meta[0].get(key) for key in self.CHECKED},
                "tokenized_max_length": None if None in lengths else max(lengths)}


def open_sources(spec: str):
    """The row source of the ``train`` key: :func:`open_rows` of one path, or a :class:`ConcatRows` of a
    comma-separated list (:func:`split_sources`).

    Raises:
        FileNotFoundError: nothing usable at a path (named).
        ValueError: see :func:`split_sources`, :func:`open_rows` and :class:`ConcatRows`.
    """
    paths = split_sources(spec)
    return open_rows(paths[0]) if len(paths) == 1 else ConcatRows(paths)


# ------------------------------------------------------------------------------------- order


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """Row order of ``epoch``: a permutation of range(n) that depends only on (seed, epoch)."""
    g = torch.Generator().manual_seed(int(seed) * 100_003 + int(epoch))
    return torch.randperm(n, generator=g).tolist()


@dataclass(frozen=True)
class DataPosition:
    epoch: int  # 0-based epoch of the step
    index: int  # index into that epoch's permutation where the step's global batch starts


class StepOrder:
    """Which rows each rank reads at each optimizer step (see module docstring).

    Raises:
        ValueError: fewer rows than one global batch.
    """

    def __init__(self, n_rows: int, micro_batch_size: int, grad_accum: int, world: int, seed: int):
        self.n, self.mb, self.ga, self.world, self.seed = n_rows, micro_batch_size, grad_accum, world, seed
        self.global_batch = micro_batch_size * grad_accum * world
        self.steps_per_epoch = n_rows // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(f"{n_rows} rows are fewer than one global batch of {self.global_batch} "
                             f"(micro_batch_size {micro_batch_size} x grad_accum {grad_accum} x {world} ranks)")
        self._perm: tuple[int, list[int]] | None = None

    def position(self, step: int) -> DataPosition:
        return DataPosition(step // self.steps_per_epoch, (step % self.steps_per_epoch) * self.global_batch)

    def rank_rows(self, step: int, rank: int) -> list[list[int]]:
        """Row indices of ``rank`` at 0-based ``step``: grad_accum lists of micro_batch_size each."""
        pos = self.position(step)
        if self._perm is None or self._perm[0] != pos.epoch:
            self._perm = (pos.epoch, epoch_permutation(self.n, self.seed, pos.epoch))
        batch = self._perm[1][pos.index: pos.index + self.global_batch]
        mine = batch[rank:: self.world]
        return [mine[m * self.mb: (m + 1) * self.mb] for m in range(self.ga)]


# ------------------------------------------------------------------------------------- batches


@dataclass
class MicroBatch:
    """One micro-batch on the CPU (``to()`` moves it). Shapes: B rows, S padded length, N anchors."""

    input_ids: torch.Tensor  # [B, S] int64, right-padded with pad_id
    attention_mask: torch.Tensor | None  # [B, S] int64 (None when no row is padded)
    lengths: torch.Tensor  # [B] int64 valid tokens per row
    anchors: torch.Tensor  # [B, N] int64, -1 = padding
    block_ids: torch.Tensor  # [B, N*bs] int64: [x_a, MASK, ...] per block
    labels: torch.Tensor  # [B, N*bs] int64: token at a + k
    weights: torch.Tensor  # [B, N*bs] fp32: exp(-(k-1)/γ)·loss_mask[a+k], 0 at slot 0 / padding
    features: torch.Tensor | None  # [B, S, k*H] offline target features, else None
    row_ids: list[int]  # indices into the row source
    skipped: int  # rows with no valid anchor (they contribute nothing)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def weight_sum(self) -> float:
        return float(self.weights.double().sum())

    def pin_memory(self) -> MicroBatch:
        """Page-locked copy (DataLoader ``pin_memory=True`` calls this), so ``to(cuda)`` overlaps compute."""
        pin = lambda t: None if t is None else t.pin_memory()
        return MicroBatch(pin(self.input_ids), pin(self.attention_mask), pin(self.lengths), pin(self.anchors),
                          pin(self.block_ids), pin(self.labels), pin(self.weights), pin(self.features),
                          self.row_ids, self.skipped)

    def to(self, device) -> MicroBatch:
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)
        return MicroBatch(mv(self.input_ids), mv(self.attention_mask), mv(self.lengths), mv(self.anchors),
                          mv(self.block_ids), mv(self.labels), mv(self.weights), mv(self.features),
                          self.row_ids, self.skipped)


def make_batch(rows: list[dict], row_ids: list[int], *, max_length: int, block_size: int, mask_token_id: int,
               gamma: float, anchors_per_seq: int, generator: torch.Generator, pad_to_multiple: int = 1,
               static_anchors: bool = False, pad_id: int = 0) -> MicroBatch:
    """Collate rows (truncated to ``max_length``, right-padded) and draw their anchors.

    ``static_anchors`` pads the anchor dimension to ``anchors_per_seq`` (fixed shapes for the
    compiled flex path); ``pad_to_multiple`` rounds the padded length up (at most max_length)."""
    ids = [r["input_ids"][:max_length] for r in rows]
    masks = [r["loss_mask"][:max_length] for r in rows]
    lengths = [len(x) for x in ids]
    S = max(lengths)
    S = max(S, min(-(-S // pad_to_multiple) * pad_to_multiple, max_length))
    B = len(rows)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.long)
    for i, (x, m) in enumerate(zip(ids, masks)):
        input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    lens = torch.tensor(lengths, dtype=torch.long)
    attention_mask = (torch.arange(S)[None] < lens[:, None]).long() if min(lengths) < S else None
    anchors = sample_anchors(list(loss_mask), lengths, anchors_per_seq, generator,
                             pad_to=anchors_per_seq if static_anchors else None)
    labels, weights = block_targets(input_ids, loss_mask, lens, anchors, block_size, gamma)
    features = None
    if "features" in rows[0]:
        f0 = rows[0]["features"]
        features = torch.zeros(B, S, f0.shape[-1], dtype=f0.dtype)
        for i, r in enumerate(rows):
            f = r["features"][: lengths[i]]
            features[i, : len(f)] = f
    skipped = int(((anchors >= 0).sum(1) == 0).sum())
    return MicroBatch(input_ids, attention_mask, lens, anchors, block_input_ids(input_ids, anchors, block_size,
                      mask_token_id), labels, weights, features, list(row_ids), skipped)


class StepBatches(torch.utils.data.Dataset):
    """Item ``i`` = the micro-batches of optimizer step ``steps[i]`` on ``rank`` (a pure function of the step).

    Wrapped in a ``DataLoader`` (``batch_size=None``, worker processes, pinned memory), the CPU work of
    collating rows and drawing anchors for the next steps overlaps the GPU step; the result is the same
    as building them in the loop, so resume stays exact.
    """

    def __init__(self, rows, order: StepOrder, steps: range, rank: int, seed: int, batch_kw: dict, vocab_size: int,
                 source: str):
        self.rows, self.order, self.steps, self.rank, self.seed = rows, order, steps, rank, seed
        self.batch_kw, self.vocab_size, self.source = batch_kw, vocab_size, source

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> list[MicroBatch]:
        step = self.steps[i]
        out = []
        for m, ids in enumerate(self.order.rank_rows(step, self.rank)):
            gen = anchor_generator(self.seed, step, 0, m * self.order.world + self.rank)  # module docstring: Anchors
            b = make_batch([self.rows.row(j) for j in ids], ids, generator=gen, **self.batch_kw)
            top = int(b.input_ids.max())
            if top >= self.vocab_size:
                raise ValueError(f"{self.source} rows {list(b.row_ids)} hold token id {top} >= the target's "
                                 f"vocabulary ({self.vocab_size} rows): tokenized for another target?")
            out.append(b)
        return out


def step_loader(dataset: StepBatches, workers: int, pin: bool):
    """Batches of each step in order, built ``workers`` processes ahead (0 = in the loop)."""
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers,
                                       pin_memory=pin, prefetch_factor=4 if workers else None,
                                       persistent_workers=False, collate_fn=lambda x: x)
