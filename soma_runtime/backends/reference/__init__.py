"""The reference backend: every op runs as its atom decomposition (ir/atoms.py). It registers no
jets on purpose, so each lookup falls through to the atoms: slow, obvious and the spec for the rest."""

NAME = "reference"


def detect() -> dict:
    return {"available": True, "runs": "atom decompositions in numpy (f64)"}
