"""String ops, computed at import on string constants (the IR has no string dtype: convert.py): StringNormalizer."""
from __future__ import annotations

import numpy as np

from soma_runtime.loaders.onnx.ops.table import onnx_op

UNICODE_CASING = ("C.UTF-8", "C.utf8", "en_")      # locales whose casing is Unicode's simple mapping (by prefix)


def lower(word: str) -> str:
    """Each character's simple lowercase, as onnxruntime's towlower gives it ('İ' is 'i'; 'Σ' is 'σ' anywhere)."""
    return "".join(c.lower()[0] for c in word)


def upper(word: str) -> str:
    """Each character's simple uppercase ('ß' stays 'ß', where Python's full mapping gives 'SS')."""
    return "".join(u if len(u := c.upper()) == 1 else c for c in word)


@onnx_op("StringNormalizer")
def string_normalizer(cv, n):
    """[C] or [1, C] strings less the stopwords (matched as written, or lowercased unless `is_case_sensitive`),
    changed to LOWER or UPPER case; all of them stopwords: one empty string."""
    x = cv.known(n.inputs[0], "strings")
    if x.dtype.kind != "U" or not (x.ndim == 1 or x.ndim == 2 and x.shape[0] == 1) or x.size == 0:
        raise cv.invalid(f"its input is {x.dtype} of shape {list(x.shape)}, not strings of shape [C] or [1, C]")
    locale = n.attr("locale", "")
    if locale and not locale.startswith(UNICODE_CASING):            # unset: onnxruntime's en_US.UTF-8
        raise cv.unsupported(f"locale {locale!r}: only locales with Unicode's casing (en_*, C.UTF-8) are supported")
    stopwords = [s.decode() if isinstance(s, bytes) else s for s in n.attr("stopwords", [])]
    sensitive = bool(n.attr("is_case_sensitive", 0))
    stop = set(stopwords) if sensitive else {lower(s) for s in stopwords}
    kept = [w for w in x.reshape(-1).tolist() if (w if sensitive else lower(w)) not in stop] or [""]
    change = {"LOWER": lower, "UPPER": upper, "NONE": str}.get(n.attr("case_change_action", "NONE"))
    if change is None:
        raise cv.invalid(f"case_change_action {n.attr('case_change_action')!r} is none of LOWER, UPPER, NONE")
    return np.array([change(w) for w in kept], str).reshape(x.shape[:-1] + (-1,))
