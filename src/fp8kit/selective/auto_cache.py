"""The cache of ``selective_fp8 = "auto"`` measurements: one small JSON file per measured shape.

Where: ``<data.cache_dir>/selective_auto/<digest>.json`` (``data.cache_dir`` defaults to
``$XDG_CACHE_HOME/fp8kit`` or ``~/.cache/fp8kit``, the cache of tokenizers and token files). The file name is
the SHA-256 of the key (:func:`cache_key`): the GPU's name, the versions of torch, torchao, fp8kit, CUDA and
Triton, the shape (per-rank GEMMs, tokens, local experts), the dtype, the FP8 recipe (grouped units: the
grouped-GEMM kernel), tp / ep, whether the site was compiled, and the timing method. A file is trusted only
if it parses, carries this very key and holds positive finite milliseconds; anything else gives a
one-line warning and the shape is measured again (and the file rewritten). Files are written through a
temporary name and a rename, so concurrent runs never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from fp8kit.data.tokenizer import atomic_write_bytes
from fp8kit.selective.auto import AutoShape, Timing

CACHE_FORMAT = "fp8kit-auto-timing"
#: 2: the delayed recipe's fprop runs with fast accumulation (session 39): version-1 timings of its sites are stale
#: (those of the other recipes are measured once more with them). 3: and its wgrad too (session 42); from version 3
#: a dense recipe's key spells its accumulation out (``bench.auto.shape_recipe_key``), so a change of a default
#: no longer needs a new version.
CACHE_VERSION = 3
#: The timing method (``bench/timing.py``): changes of it invalidate every entry.
TIMING_METHOD = "v2: device queue held by torch.cuda._sleep, median of 3 repeats; perf_counter on CPU"
#: The library versions of a key (the rest of ``base.runtime.versions()`` does not change a GEMM's speed).
KEY_VERSIONS = ("torch", "torchao", "fp8kit", "cuda", "triton")


def cache_key(shape: AutoShape, *, device: str, versions: dict[str, str], recipe: str, tp: int, ep: int,
              compiled: bool, dtype: str = "bfloat16") -> dict:
    """The key of one measurement (module docstring): plain JSON data.

    ``recipe`` is the FP8 recipe of a dense unit, or ``"grouped:<kernel>"`` of a grouped one.
    """
    return {
        "device": device,
        "versions": {k: str(versions.get(k)) for k in KEY_VERSIONS},
        "shape": shape.to_dict(),
        "dtype": dtype,
        "recipe": recipe,
        "tp": tp,
        "ep": ep,
        "compiled": compiled,
        "timing": TIMING_METHOD,
    }


def key_digest(key: dict) -> str:
    """SHA-256 (first 32 hex digits) of the key's canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


class AutoCache:
    """The measurements under ``root / "selective_auto"``.

    Args:
        root: the cache directory (``fp8kit.data.tokenizer.resolve_cache_dir(data.cache_dir)``).
    """

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "selective_auto"

    def path(self, key: dict) -> Path:
        return self.dir / f"{key_digest(key)}.json"

    def load(self, key: dict) -> tuple[Timing | None, str | None]:
        """``(timing, None)`` on a hit, ``(None, None)`` when there is no file, ``(None, warning)`` when the file
        cannot be trusted (unreadable, invalid JSON, another key, bad values): never raises."""
        p = self.path(key)
        if not p.exists():
            return None, None
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return None, f"selective_fp8 = auto: cache file {p} is unreadable ({_one_line(e)}); measuring again"
        problem = _problem(data, key)
        if problem:
            return None, f"selective_fp8 = auto: cache file {p} {problem}; measuring again"
        return Timing(data["bf16_ms"], data["fp8_ms"], source="cache", error=data.get("error")), None

    def save(self, key: dict, timing: Timing) -> str | None:
        """Write one entry; returns a warning instead of raising when the directory cannot be written."""
        payload = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                   "key": key, "bf16_ms": timing.bf16_ms, "fp8_ms": timing.fp8_ms, "error": timing.error}
        p = self.path(key)
        try:
            atomic_write_bytes(p, (json.dumps(payload, indent=1) + "\n").encode())
        except OSError as e:
            return f"selective_fp8 = auto: cannot write the cache file {p} ({_one_line(e)}); the next run measures again"
        return None


def _problem(data, key: dict) -> str | None:
    """Why a parsed cache file is not a valid entry of ``key`` (None if it is)."""
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        return f"is not a {CACHE_FORMAT} file"
    if data.get("version") != CACHE_VERSION:
        return f"has version {data.get('version')!r}, not {CACHE_VERSION}"
    if data.get("key") != key:
        return "holds another key than its name says"
    error = data.get("error")
    if error is not None and not isinstance(error, str):
        return "has a non-text error"
    for name in ("bf16_ms", "fp8_ms"):
        v = data.get(name)
        if v is None and error:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            return f"has {name} = {v!r}, not a positive number of milliseconds"
    return None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
