"""What every start would otherwise convert again, kept on disk: a GGUF file's tokenizer (transformers builds it
from the file's vocabulary in ~10 s), its config, and its tensors dequantized (the gguf package parses and
dequantizes them in ~8 s), keyed by the file's path, size and modification time, so an edited or replaced file
is converted afresh. Directory: $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill;
TOKENMILL_CACHE_DIR=off turns it off. A cache that cannot be written only costs the next start its time."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.utils import init_logger

if TYPE_CHECKING:   # the tensors' entries only: the API server reads the tokenizer and config without torch
    import torch

logger = init_logger(__name__)

FORMAT_VERSION = 1   # bump when what is cached, or how it is converted, changes


def cache_root() -> Path | None:
    env = os.environ.get("TOKENMILL_CACHE_DIR")
    if env == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill"


def entry_dir(source: str, kind: str, *parts: object) -> Path | None:
    """The folder for `kind` of `source` (a file) under these `parts`; None when caching is off."""
    root = cache_root()
    if root is None:
        return None
    st = os.stat(source)
    ident = f"{FORMAT_VERSION}|{os.path.abspath(source)}|{st.st_size}|{st.st_mtime_ns}|{kind}|{parts}"
    return root / f"{Path(source).stem}-{kind}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def cached_folder(source: str, kind: str, build: Callable[[Path], None], *parts: object) -> Path | None:
    """The cached folder, made by `build(tmp_folder)` on a miss and moved into place whole (a start that dies
    half-way leaves no half entry; two starts racing both build, one wins). None when caching is off or the
    folder cannot be written."""
    final = entry_dir(source, kind, *parts)
    if final is None:
        return None
    if (final / ".complete").exists():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".complete").touch()
            os.rename(tmp, final)
        except OSError:
            if not (final / ".complete").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("start cache: could not write %s (%s); the next start converts again", final, e)
        return None
    logger.info("start cache: wrote %s", final)
    return final


def cached_tensors(source: str, what: str, dtype: torch.dtype,
                   convert: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`convert()`'s (name, tensor) pairs, from a safetensors file of them in `dtype` when one is cached (read
    through a memory map); on a miss they are converted, yielded, and written for the next start."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    entry = entry_dir(source, what, str(dtype))
    if entry is not None and (entry / ".complete").exists():
        with safe_open(str(entry / "weights.safetensors"), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in convert():
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(dtype)
            kept[name] = tensor
        yield name, tensor
    if entry is not None:
        cached_folder(source, what, lambda tmp: save_file(kept, str(tmp / "weights.safetensors")), str(dtype))
