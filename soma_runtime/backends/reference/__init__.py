"""The reference backend: every op runs as its atom decomposition (ir/atoms.py). It registers no
jets on purpose, so each lookup falls through to the atoms: slow, obvious and the spec for the rest."""
from soma_runtime.ir.backend import Backend


class ReferenceBackend(Backend):
    name = "reference"

    def detect(self) -> dict:
        return {"available": True, "runs": "atom decompositions in numpy (f64)"}


BACKEND = ReferenceBackend()
