"""The official OpenAI Python client against the ecx proxy (encoder + pd + proxy, p2p):
a chat completion with an image, the same one streamed, an error, and the model list."""

import base64

import openai
import pytest

from ecx_stack import REPO_ROOT, EcxStack, assert_all_stopped_cleanly

MODEL = "ecx-tiny-vl"
MAX_TOKENS = 12
SAMPLE_IMAGE = REPO_ROOT / "tests" / "data" / "sample.png"


@pytest.fixture(scope="module")
def stack(ecx_binary, tmp_path_factory):
    """Encoder, pd and proxy for this module; all stopped (and checked) at its end."""
    with EcxStack(ecx_binary, tmp_path_factory.mktemp("openai-client-stack")) as s:
        s.start_epd()
        yield s
    assert_all_stopped_cleanly(s)


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.proxy.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def messages():
    image = "data:image/png;base64," + base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
    return [{
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": image}},
        ],
    }]


@pytest.fixture(scope="module")
def completion(client, messages):
    """One non-streaming completion, shared: the streaming test compares against it."""
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


def test_chat_completion_with_an_image_generates_max_tokens(completion):
    text = completion.choices[0].message.content
    assert len(text) == MAX_TOKENS, f"text {text!r}"
    assert completion.usage.completion_tokens == MAX_TOKENS


def test_streamed_completion_matches_the_non_streamed_one(client, messages, completion):
    streamed, finish = "", None
    with client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                        extra_body={"ignore_eos": True}, stream=True) as stream:
        for chunk in stream:
            if chunk.choices:
                streamed += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    assert streamed == completion.choices[0].message.content
    assert finish == "length"


def test_unknown_model_is_a_bad_request(client, messages):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="no-such-model", messages=messages)
    assert error.value.status_code == 400


def test_models_list_includes_the_served_model(client):
    assert MODEL in [m.id for m in client.models.list()]
