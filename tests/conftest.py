"""Test-session settings: the autotune table lives in a fresh directory, never the user's cache."""
from __future__ import annotations

import os
import tempfile

os.environ["SOMA_CACHE_DIR"] = tempfile.mkdtemp(prefix="soma-test-cache-")
