"""The workload the vLLM engine tests send, and a single vLLM instance (no EC connector)
whose greedy answers are the reference every EPD answer must equal."""
from __future__ import annotations

from vllm_engines import Engine, free_port, messages, mp4, png, post, serve_argv, vllm_env

IMAGES = [png(seed) for seed in range(1, 10)]
_fresh = {}
# (images, prompt): one image, several, a repeated one, the same image twice in one request.
REQUESTS = [
    ([0], "What is in the picture?"),
    ([1], "Describe it."),
    ([2, 3], "Compare the two images."),
    ([4, 5, 6], "Three images: which is brightest?"),
    ([7], "One more."),
    ([1, 8], "A repeated image and a new one."),
    ([3, 3], "The same image twice."),
    ([8, 0, 2, 5], "Four images."),
]
MAX_TOKENS = 8


def fresh(seed: int, n_images: int = 1) -> int:
    """A request no engine has seen (new images, new prompt), so that neither vLLM's
    prefix cache nor its encoder cache can stand in for the load; its index."""
    if seed not in _fresh:
        first = len(IMAGES)
        IMAGES.extend(png(1000 * seed + i) for i in range(n_images))
        REQUESTS.append((list(range(first, first + n_images)), f"Fresh request {seed}."))
        _fresh[seed] = len(REQUESTS) - 1
    return _fresh[seed]


def fresh_video(seed: int, frames: int, with_image: bool = False) -> int:
    """A request with a video no engine has seen (and a fresh image beside it); its index."""
    key = ("video", seed, frames, with_image)
    if key not in _fresh:
        IMAGES.append(mp4(seed, frames=frames))
        media = [len(IMAGES) - 1]
        if with_image:
            IMAGES.append(png(seed))
            media.append(len(IMAGES) - 1)
        REQUESTS.append((media, f"What happens in video {seed}?"))
        _fresh[key] = len(REQUESTS) - 1
    return _fresh[key]


def chat_body(index: int, **extra) -> dict:
    images, text = REQUESTS[index]
    return {"model": "tiny-vlm", "messages": messages(text, [IMAGES[i] for i in images]),
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


def images_of(index: int) -> list[str]:
    return [IMAGES[i] for i in REQUESTS[index][0]]


class Reference:
    """A single vLLM instance; answers computed once each."""

    def __init__(self, model, log_dir):
        port = free_port()
        self.engine = Engine("reference", serve_argv(model, port), vllm_env(), port,
                             log_dir / "reference.log")
        self._texts: dict[int, str] = {}
        self._ready = False

    def text(self, index: int) -> str:
        if not self._ready:
            self.engine.wait_ready()
            self._ready = True
        if index not in self._texts:
            status, body = post(self.engine.url + "/v1/chat/completions", chat_body(index))
            assert status == 200, body
            self._texts[index] = body["choices"][0]["message"]["content"]
        return self._texts[index]
