"""Which backends this machine can test: reference and cpu everywhere, cuda where a GPU is present."""
from soma_runtime.backends import BACKENDS as KNOWN
from soma_runtime.backends import detect_all

BACKENDS = [name for name, info in detect_all().items() if name in KNOWN and info.get("available")]
