"""A model's tokenizer (transformers' fast tokenizer), loaded without torch where transformers allows it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

# what transformers writes as the tokenizer class of a plain fast tokenizer (a GGUF file's, saved by the start cache)
_PLAIN_FAST = "TokenizersBackend"


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """A transformers fast tokenizer; for a GGUF file it is built from the file's own vocabulary (~10 s), once:
    later starts read the start cache's saved copy."""
    from tokenmill.model.start_cache import cached_folder

    p = Path(path)
    if not (p.is_file() and p.suffix == ".gguf"):
        return _from_folder(path)

    def from_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)

    folder = cached_folder(path, "tokenizer", lambda tmp: from_file().save_pretrained(str(tmp)))
    return from_file() if folder is None else _from_folder(str(folder))


def _from_folder(folder: str):
    """AutoTokenizer's choice. A folder whose class is the plain fast tokenizer is loaded with that class
    directly: AutoTokenizer's module imports transformers' config machinery, and that imports torch (~2-4 s of
    the API server's cold start); the class itself does not."""
    cfg = Path(folder) / "tokenizer_config.json"
    if cfg.is_file() and json.loads(cfg.read_text()).get("tokenizer_class") == _PLAIN_FAST:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
