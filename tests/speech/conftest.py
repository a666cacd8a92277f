"""Fixtures the speech tests share with the ONNX model tests: the piper voice and the speech it says."""
from tests.loaders.test_onnx_models import speech, voice  # noqa: F401  (fixtures)
