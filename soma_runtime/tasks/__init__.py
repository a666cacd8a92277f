"""The library surface (SPEC "library API"): Runtime loads models; a model is run by its task.

    rt = Runtime()
    model = rt.load("model.gguf")              # or a HF/soma directory, or "default"  -> TextModel
    for token in model.generate("Once upon", max_tokens=32, temperature=0):
        print(token.text, end="")
    print(model.chat([{"role": "user", "content": "Hi"}], stream=False))
    model.metrics()                            # prefill/decode ms and tok/s, peak memory
    rt.load("minilm").embed(["a text"])        # an encoder directory -> EncoderModel
    rt.load(graph).run({"x": array})           # a Graph built in code -> GraphModel
    rt.load("whisper-tiny.en").transcribe("talk.wav").text   # a whisper directory -> SpeechModel
    samples, rate = rt.load("voice.onnx").speak("Hello.")   # a piper voice -> VoiceModel
    rt.pipeline("whisper-tiny.en", "default", "voice.onnx")("question.wav").samples   # speech in, speech out
    rt.load("yolo11n.onnx").detect("photo.jpg")   # an ultralytics detect export -> DetectModel: [Detection, ...]
    rt.load("vit-base-patch16-224").classify_image("cat.jpg", top_k=5)   # a ViT directory -> ImageEncoderModel

One Model class per task (`generate`, `encode`, `graph`, `transcribe`, `speak`, `detect`, `encode_image`), a
module each (text, encode, graph, speech, voice, detect, vision) over a shared base (base); each holds its task's
runner (engine/), built on the Backend the scheduling policy (schedule.py) gives it. pipeline chains three of them;
runtime loads them.
"""
from soma_runtime.tasks.base import METHOD_TASKS, Model, check_count, check_flag
from soma_runtime.tasks.detect import DetectModel
from soma_runtime.tasks.encode import EncoderModel
from soma_runtime.tasks.graph import GraphModel
from soma_runtime.tasks.pipeline import Pipeline, Reply
from soma_runtime.tasks.runtime import TASKS, Runtime
from soma_runtime.tasks.speech import SpeechModel
from soma_runtime.tasks.text import TextModel
from soma_runtime.tasks.vision import ImageEncoderModel
from soma_runtime.tasks.voice import VoiceModel

__all__ = ["METHOD_TASKS", "TASKS", "DetectModel", "EncoderModel", "GraphModel", "ImageEncoderModel", "Model", "Pipeline",
           "Reply", "Runtime", "SpeechModel", "TextModel", "VoiceModel", "check_count", "check_flag"]
