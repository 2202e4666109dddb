"""Where a model comes from: a local folder, a ``.gguf`` file, or a Hugging Face Hub id.

Every loader (``dspine.*``, ``infer.*``, ``data.*``, ``train/``) resolves its ``--target`` /
``--tokenizer`` here first, so a mistyped local path is reported as a missing path, not as a
malformed Hub repo id; :func:`load_tokenizer` is the one tokenizer loader. :func:`read_json_object` reads
the JSON files the tools take (configs, manifests, run arguments) and names the file when one is not a JSON
object.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path


def read_json_object(path: str | Path, what: str = "") -> dict:
    """The JSON object in ``path``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not valid JSON, or valid JSON that is not an object (``[1]``, ``"x"``, ``null``);
            the message names the file (and ``what`` it should hold).
    """
    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not a text file ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{p}: expected a JSON object{f' ({what})' if what else ''}, got {type(obj).__name__} "
                         f"{json.dumps(obj)[:40]}")
    return obj

# "name" or "org/name" (huggingface_hub's repo id rule, loosely): anything else is a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def looks_local(path_or_id: str) -> bool:
    """True for a string that can only be a local path: it starts with ``/ . ~`` or is no Hub id."""
    return path_or_id.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(path_or_id)


def output_arg(ap, args) -> None:
    """argparse error (``ap.error``), before any work, when ``args.output`` is given and cannot be written
    (:func:`check_output_file` with ``--output`` and ``args.overwrite``: an empty name, a folder, an existing file
    without ``--overwrite``, an unwritable place)."""
    if args.output is not None:
        try:
            check_output_file("--output", args.output, args.overwrite)
        except ValueError as e:
            ap.error(str(e))


def check_output_file(flag: str, path: str | Path, overwrite: bool) -> None:
    """Check, before any work, that the output file ``path`` of option ``flag`` can be written: not a folder,
    not an existing file unless ``overwrite``, its nearest existing parent a writable folder.

    Raises ValueError naming ``flag`` and the path (an empty one: give a file name; one ending in a slash names a
    folder)."""
    if not str(path).strip():  # Path("") is ".", a folder: say what is missing instead
        raise ValueError(f"{flag}: give a file name")
    p = Path(path)
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash: "out/" would become a file named "out"
        raise ValueError(f"{flag} {path} names a folder (a trailing slash); give a file name")
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    if p.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists; pass --overwrite to replace it or choose another name")
    parent = next((q for q in p.parents if q.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot create it under {parent} (not a writable folder)")
    try:  # os.access says yes to root everywhere, /proc and read-only mounts included: create a file to be sure
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".dspine-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create it under {parent} ({e.strerror})") from None


def resolve_model_path(path_or_id: str, gguf_file: str | None = None, what: str = "target",
                       need_config: bool = False) -> tuple[str, str | None]:
    """Split ``path/to/model.gguf`` into (folder, gguf file name); other folders and Hub ids pass through.

    Args:
        what: the role, for error messages ("target", "tokenizer").
        need_config: a local folder without ``--gguf-file`` must hold ``config.json``.
    Raises:
        FileNotFoundError: a local-looking path, or the GGUF file, that does not exist.
        ValueError: an existing file that is not ``.gguf``, or a folder without ``config.json``; a
            truncated or corrupt GGUF file (:func:`dspine.gguf_file.check_gguf`, before transformers
            parses it); a GGUF file without the gguf package installed
            (:class:`dspine.gguf_file.GGUFPackageMissing`, also an ImportError).

    A local GGUF file also turns on :func:`dspine.gguf_file.memo_gguf_metadata` (one metadata parse per file).
    """
    from dspine.gguf_file import check_gguf, memo_gguf_metadata

    p = Path(path_or_id).expanduser()
    if gguf_file is None and p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{what} GGUF file not found: {path_or_id}")
        check_gguf(p)
        memo_gguf_metadata()
        return str(p.parent), p.name
    if not p.exists():
        if looks_local(path_or_id):
            raise FileNotFoundError(f"{what} {path_or_id}: no such file or folder, and not a Hub id")
        return path_or_id, gguf_file  # a Hub id
    if not p.is_dir():
        if gguf_file is not None:  # --gguf-file names a file inside a folder: the path must be that folder
            raise ValueError(f"{what} {path_or_id}: a file, but a GGUF file name ({gguf_file}) was given too; with it "
                             "give the folder that holds that file, or give the .gguf path alone")
        raise ValueError(f"{what} {path_or_id}: not a model folder (a file; expected a folder, Hub id or .gguf file)")
    if gguf_file is not None:
        if not (p / gguf_file).is_file():
            raise FileNotFoundError(f"{what} GGUF file not found: {p / gguf_file}")
        check_gguf(p / gguf_file)
        memo_gguf_metadata()
    if gguf_file is None and (p / "config.json").is_file():
        read_json_object(p / "config.json", f"the {what}'s model config")
    elif need_config and gguf_file is None:
        # a folder one level up from the model (e.g. a download holding hf/ and a GGUF): name what it holds
        inner = sorted(str(c.parent) for c in p.glob("*/config.json"))[:3] + sorted(str(g) for g in p.glob("*.gguf"))[:3]
        hint = f"; it holds {', '.join(inner)}: give one of those" if inner else ""
        raise ValueError(f"{what} {path_or_id}: not a model folder (no config.json){hint}")
    return (str(p) if path_or_id.startswith("~") else path_or_id), gguf_file


def snapshot_folder(path_or_id: str) -> Path:
    """``path_or_id`` itself when it is a folder, else the folder of its Hub snapshot: the ``*.json`` and
    ``*.safetensors`` files (``huggingface_hub.snapshot_download``; the drafts' and the targets' weight loaders)."""
    if Path(path_or_id).is_dir():
        return Path(path_or_id)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path_or_id, allow_patterns=["*.json", "*.safetensors"]))


@contextlib.contextmanager
def hub_errors(what: str, path_or_id: str):
    """Re-raise an ``OSError`` of loading a Hub id (no network, no such repo, gated) as one line that
    names the id; errors about an existing local path pass through unchanged."""
    try:
        yield
    except OSError as e:
        if Path(str(path_or_id)).expanduser().exists():
            raise
        detail = " ".join(str(e).split())
        detail = detail[: detail.find(". ") + 1 or 240][:240]  # the first sentence
        raise OSError(f"{what} {path_or_id}: not a local path, and it could not be loaded from the Hugging Face "
                      f"Hub ({type(e).__name__}: {detail})") from None


def load_tokenizer(path_or_id: str, gguf_file: str | None = None):
    """AutoTokenizer, falling back to ``PreTrainedTokenizerFast`` on a bare ``tokenizer.json``.

    Raises:
        OSError: one line naming a Hub id that cannot be loaded (no network, no such repo).
        ValueError: one line naming ``path_or_id`` when transformers finds no tokenizer there (a folder without
            tokenizer files).
    """
    path_or_id, gguf_file = resolve_model_path(path_or_id, gguf_file, what="tokenizer")
    with hub_errors("tokenizer", path_or_id):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        tok_json = Path(path_or_id) / "tokenizer.json"
        cfg_file = Path(path_or_id) / "config.json"
        # A Llama folder with only tokenizer.json (e.g. stories260K) loads as a fast tokenizer directly;
        # AutoTokenizer would pick a slow sentencepiece class that needs files we do not have.
        if tok_json.is_file() and cfg_file.is_file() and not (Path(path_or_id) / "tokenizer.model").exists():
            if read_json_object(cfg_file, "a model config").get("model_type") == "llama":
                return PreTrainedTokenizerFast.from_pretrained(path_or_id)
        try:
            return AutoTokenizer.from_pretrained(path_or_id, **({"gguf_file": gguf_file} if gguf_file else {}))
        except ValueError as e:  # e.g. a folder without tokenizer files: transformers' lines do not name it
            raise ValueError(f"{path_or_id}: no tokenizer loads from it ({' '.join(str(e).split())})") from None
