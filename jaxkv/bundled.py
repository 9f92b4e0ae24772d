"""The files jaxkv ships besides its code: the project's small reference model and the gates
trained for it (`assets/` in the repository).

`jaxkv/assets` is a link to the repository's `assets/`, and a wheel carries the same files inside
the package (package data), so these paths hold in a source checkout, an editable install and an
installed wheel alike. Everything that needs a bundled file takes its path from here.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = (Path(__file__).parent / "assets").resolve()
# The reference model in Hugging Face format, with its byte-level tokenizer
# (docs/reference-model.md); `jaxkv generate` uses it without --model.
REFERENCE_MODEL = ASSETS / "reference-model"
# WG-KV write gates for the reference model, one directory per sparsity weight (docs/wgkv.md).
WGKV_GATES = ASSETS / "wgkv-gates"
# Fast KVzip gates for the reference model (docs/fastkvzip.md).
FASTKVZIP_GATES = ASSETS / "fastkvzip-gates"
