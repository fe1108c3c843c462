"""The model's recommended sampling, read for the plan's meta["sampling"] (strata_compiler/sampling.py
says how the runtime uses it).

Hugging Face folder: generation_config.json's `temperature`, `top_k`, `top_p`, `min_p` and
`repetition_penalty`. `do_sample` is not read: transformers writes `false` into files whose authors
chose nothing (its own default), and Strata's default is to sample.
GGUF: llama.cpp's `general.sampling.temp`, `.top_k`, `.top_p`, `.min_p`, `.penalty_repeat` and
`.penalty_last_n` (gguf-py's Keys.General.SAMPLING_*), in llama.cpp's sense: a temperature <= 0 is
greedy, a top-k <= 0 off, a window of -1 every token seen. Only what the file gives is stored; a
value of the wrong type, out of range or not finite (NaN, -inf) is one ModelError naming the file
and the field (files are untrusted input).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError
from ..sampling import check
from .hf import read_json_object

HF_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}


def _checked(name: str, value: object, where: str) -> int | float:
    try:
        return check(name, value)
    except ValueError as e:
        raise ModelError(f"{where}: {e}") from None


def hf_sampling(model_dir: Path) -> dict | None:
    """meta["sampling"] of a Hugging Face folder; None when generation_config.json gives none."""
    path = model_dir / "generation_config.json"
    gc = read_json_object(path) or {}
    out = {name: _checked(name, gc[name], f"{path}: field {name!r}") for name in HF_FIELDS
           if gc.get(name) is not None}
    return {"source": "generation_config.json", **out} if out else None


def gguf_sampling(path: Path, reader: Any) -> dict | None:
    """meta["sampling"] of a GGUF file (its `gguf.GGUFReader`); None when it has no sampling keys."""
    out = {}
    for key, name in GGUF_KEYS.items():
        field = reader.fields.get(key)
        if field is None:
            continue
        where = f"{path}: GGUF metadata {key!r}"
        try:
            v = field.contents()
        except Exception:       # noqa: BLE001 - gguf's parse errors on a corrupt field
            raise ModelError(f"{where} cannot be read; the file is corrupt") from None
        if isinstance(v, float) or isinstance(v, np.floating):
            with np.errstate(over="ignore"):    # an f64 beyond f32 becomes inf, which _checked refuses
                v = float(str(np.float32(v)))   # stored as f32: 0.95 reads back 0.949999988; the shortest f32 decimal
        if isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v):
            if name == "temperature" or name == "top_k":
                v = max(v, 0)               # llama.cpp: <= 0 is greedy / off (-inf and NaN are refused)
        out[name] = _checked(name, v, where)
    return {"source": "GGUF general.sampling", **out} if out else None
