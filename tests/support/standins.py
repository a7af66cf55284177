"""Stand-in HTTP engines for what cannot run here (Ollama) and for faults a real engine won't make.

The Ollama stand-in follows Ollama's documented API (docs/api.md) field by field: /api/version,
/api/tags, /api/ps, /api/chat as application/x-ndjson with chunked transfer encoding and the final
`done` object carrying total_duration, load_duration, prompt_eval_count, prompt_eval_duration,
eval_count, eval_duration and done_reason; /api/generate with an empty prompt and keep_alive 0
unloads the model and answers done_reason "unload".
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

OLLAMA_DIGEST = "2ae6f6dd7a3dd734790bbbf58b8909a606e0e7e97e94b7604e0aa7ae4490e6d8"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.server.requests.append((self.command, self.path, body))
        return body  # type: ignore[no-any-return]

    def do_GET(self) -> None:
        self.server.requests.append((self.command, self.path, None))
        self.server.get(self)

    def do_POST(self) -> None:
        self.server.post(self, self._body())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    requests: list[tuple[str, str, Any]]
    # A gateway's key in front of the engine: each request must end in `?<query>` (None: none).
    query: str | None = None

    def route(self, handler: _Handler) -> str | None:
        """The request's path without its query; None (and 401 answered) where the gateway's
        query is not the one it needs."""
        path, _, query = handler.path.partition("?")
        if self.query is not None and query != self.query:
            handler._json(401, {"error": f"no gateway key in {handler.path!r}"})
            return None
        return path

    def get(self, handler: _Handler) -> None:
        handler._json(404, {"error": "not found"})

    def post(self, handler: _Handler, body: dict[str, Any]) -> None:
        handler._json(404, {"error": "not found"})


def _now() -> str:
    return datetime.now(UTC).isoformat()


class OllamaStandin(_Server):
    def __init__(self, model: str = "qwen3.5:0.8b", load_s: float = 0.05, token_s: float = 0.002):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        self.model = model if ":" in model else f"{model}:latest"
        self.loaded = False
        self.load_s = load_s
        self.token_s = token_s
        self.version = "0.12.3"

    def _entry(self) -> dict[str, Any]:
        return {
            "name": self.model,
            "model": self.model,
            "size": 1_000_000,
            "digest": OLLAMA_DIGEST,
            "details": {"format": "gguf", "family": "qwen3", "parameter_size": "0.8B"},
        }

    def get(self, handler: _Handler) -> None:
        path = self.route(handler)
        if path == "/api/version":
            handler._json(200, {"version": self.version})
        elif path == "/api/tags":
            handler._json(200, {"models": [{**self._entry(), "modified_at": _now()}]})
        elif path == "/api/ps":
            running = [{**self._entry(), "expires_at": _now(), "size_vram": 0}]
            handler._json(200, {"models": running if self.loaded else []})
        elif path is not None:
            handler._json(404, {"error": "not found"})

    def post(self, handler: _Handler, body: dict[str, Any]) -> None:
        path = self.route(handler)
        if path is None:
            return
        if body.get("model") not in (self.model, self.model.removesuffix(":latest")):
            handler._json(404, {"error": f"model '{body.get('model')}' not found"})
            return
        if path == "/api/generate" and not body.get("prompt") and body.get("keep_alive") == 0:
            self.loaded = False
            handler._json(
                200,
                {"model": self.model, "created_at": _now(), "response": "", "done": True,
                 "done_reason": "unload"},
            )  # fmt: skip
        elif path == "/api/chat":
            self._chat(handler, body)
        else:
            handler._json(404, {"error": "not found"})

    def _chat(self, handler: _Handler, body: dict[str, Any]) -> None:
        started = time.perf_counter_ns()
        load_ns = 0
        if not self.loaded:
            time.sleep(self.load_s)
            load_ns = time.perf_counter_ns() - started
            self.loaded = True
        num_predict = int(body.get("options", {}).get("num_predict", 8))
        handler._start_chunked("application/x-ndjson")
        eval_start = time.perf_counter_ns()
        for index in range(num_predict):
            time.sleep(self.token_s)
            line = {"model": self.model, "created_at": _now(),
                    "message": {"role": "assistant", "content": f"tok{index} "}, "done": False}  # fmt: skip
            handler._chunk(json.dumps(line).encode() + b"\n")
        eval_ns = time.perf_counter_ns() - eval_start
        final = {
            "model": self.model, "created_at": _now(),
            "message": {"role": "assistant", "content": ""},
            "done": True, "done_reason": "length",
            "total_duration": time.perf_counter_ns() - started, "load_duration": load_ns,
            "prompt_eval_count": 12, "prompt_eval_duration": 1_500_000,
            "eval_count": num_predict, "eval_duration": eval_ns,
        }  # fmt: skip
        handler._chunk(json.dumps(final).encode() + b"\n")
        handler._end_chunked()


class FaultyOpenAIServer(_Server):
    """An OpenAI-style server that misbehaves on request: the prompt text picks the fault.

    A prompt containing BREAK closes the connection mid-stream, NOTJSON sends a line that is not
    JSON, ERRLINE sends an error event mid-stream, STALL stops sending mid-stream (until the
    client gives up), FAIL500 answers HTTP 500, HANGUP closes the connection before answering,
    MISCOUNT streams normally but its `usage` claims three tokens more than it streamed (a count
    the client must not take on trust); any other prompt streams normally.

    A normal stream follows OpenAI's chat completions streaming protocol field by field: each
    `chat.completion.chunk` with `id`, `object`, `model` and `choices[{index, delta: {content},
    finish_reason}]` (`length` on the last), then, as `stream_options.include_usage` asks, a
    chunk with empty `choices` and `usage: {prompt_tokens, completion_tokens, total_tokens}`,
    then `data: [DONE]`.
    """

    def __init__(self, model: str = "m") -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        self.model = model

    def get(self, handler: _Handler) -> None:
        if handler.path == "/health":
            handler._json(200, {"status": "ok"})
        elif handler.path == "/v1/models":
            handler._json(200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            handler._json(404, {"error": "not found"})

    def post(self, handler: _Handler, body: dict[str, Any]) -> None:
        if "messages" not in body:  # /tokenize and the other kinds' paths: not served
            handler._json(404, {"error": {"message": f"no route {handler.path}", "code": 404}})
            return
        prompt = body["messages"][-1]["content"]
        if "HANGUP" in prompt:
            handler.close_connection = True
            handler.connection.shutdown(2)
            return
        if "FAIL500" in prompt:
            handler._json(500, {"error": {"message": "out of memory", "code": 500}})
            return
        handler._start_chunked("text/event-stream")
        tokens = int(body.get("max_tokens", 4))
        for index in range(tokens):
            if index == 2 and "BREAK" in prompt:
                handler.wfile.flush()
                handler.close_connection = True
                handler.connection.shutdown(2)
                return
            if index == 2 and "NOTJSON" in prompt:
                handler._chunk(b"data: {this is not json\n\n")
                continue
            if index == 2 and "ERRLINE" in prompt:
                error = {"error": {"message": "slot unavailable", "code": 503}}
                handler._chunk(f"data: {json.dumps(error)}\n\n".encode())
                continue
            if index == 2 and "STALL" in prompt:
                time.sleep(1.5)
                return
            chunk = {"id": "x", "object": "chat.completion.chunk", "model": self.model,
                     "choices": [{"index": 0, "delta": {"content": f"t{index}"},
                                  "finish_reason": "length" if index == tokens - 1 else None}]}  # fmt: skip
            handler._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            time.sleep(0.001)
        counted = tokens + 3 if "MISCOUNT" in prompt else tokens
        usage = {"id": "x", "object": "chat.completion.chunk", "model": self.model,
                 "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": counted,
                                          "total_tokens": 5 + counted}}  # fmt: skip
        handler._chunk(f"data: {json.dumps(usage)}\n\n".encode())
        handler._chunk(b"data: [DONE]\n\n")
        handler._end_chunked()


class ToolCallStandin(_Server):
    """An OpenAI-compatible server that answers a chat request with `tools` by calling one, as
    OpenAI's streaming API does: for what no model here can do (the tiny model's chat template
    makes llama-server's tool-call grammar fail, and with a template that it takes, no call
    comes back). The request is checked field by field as OpenAI documents it (tools: a list of
    {type: function, function: {name, parameters}}; tool_choice: none, auto, required or
    {type: function, function: {name}}; stream_options.include_usage), and a request that
    breaks it is answered HTTP 400 with the field named. The call streams as OpenAI's does: a
    first delta with the call's index, id, type and function name and empty arguments, then
    the arguments in pieces, then finish_reason `tool_calls` and the usage chunk.

    `arguments`: the JSON text the call's arguments stream (valid or not for the tool's schema,
    as a test sets it between runs)."""

    def __init__(self, model: str = "m", arguments: str = '{"city": "Paris"}') -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        self.model = model
        self.arguments = arguments

    def get(self, handler: _Handler) -> None:
        if handler.path == "/v1/models":
            handler._json(200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            handler._json(404, {"error": "not found"})

    @staticmethod
    def shape_error(body: dict[str, Any]) -> str | None:
        """What in a chat request with tools is not OpenAI's shape, or None."""
        tools = body.get("tools")
        if not isinstance(tools, list) or not tools:
            return "tools: a non-empty list"
        names = []
        for index, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                return f"tools[{index}].type: must be 'function'"
            function = tool.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return f"tools[{index}].function.name: a string"
            if not isinstance(function.get("parameters", {}), dict):
                return f"tools[{index}].function.parameters: a JSON Schema object"
            names.append(function["name"])
        choice = body.get("tool_choice", "auto")
        if isinstance(choice, dict):
            named = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or named not in names:
                return "tool_choice: {type: function, function: {name: <a tool's name>}}"
        elif choice not in ("none", "auto", "required"):
            return "tool_choice: none, auto, required or a named function"
        if body.get("stream") is not True or not isinstance(body.get("messages"), list):
            return "stream: true and messages: a list"
        return None

    def post(self, handler: _Handler, body: dict[str, Any]) -> None:
        if handler.path != "/v1/chat/completions":
            handler._json(404, {"error": {"message": f"no route {handler.path}"}})
            return
        problem = self.shape_error(body)
        if problem is not None:
            handler._json(400, {"error": {"message": problem, "type": "invalid_request_error"}})
            return
        choice = body.get("tool_choice")
        name = (
            choice["function"]["name"]
            if isinstance(choice, dict)
            else body["tools"][0]["function"]["name"]
        )
        handler._start_chunked("text/event-stream")

        def send(delta: dict[str, Any], finish: str | None = None) -> None:
            chunk = {"id": "c", "object": "chat.completion.chunk", "model": self.model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
            handler._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            time.sleep(0.001)

        send({"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_0", "type": "function",
             "function": {"name": name, "arguments": ""}}]})  # fmt: skip
        pieces = [self.arguments[i : i + 4] for i in range(0, len(self.arguments), 4)]
        for piece in pieces:
            send({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        send({}, "tool_calls")
        usage = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": len(pieces) + 1,
                                          "total_tokens": 13 + len(pieces)}}  # fmt: skip
        handler._chunk(f"data: {json.dumps(usage)}\n\n".encode())
        handler._chunk(b"data: [DONE]\n\n")
        handler._end_chunked()


class ImageChatStandin(_Server):
    """An OpenAI-compatible server that takes chat requests with images: for what cannot run
    here (no vision model and projector can be generated or installed on this machine; the real
    llama-server answers an image without --mmproj HTTP 500 "image input is not supported").
    The request is checked field by field as OpenAI documents a vision request: the last
    message a user turn whose `content` is a list of parts, one {type: text, text} and each
    image {type: image_url, image_url: {url: data:<image/...>;base64,<data>}}, the data valid
    base64; a request that breaks it is answered HTTP 400 with the field named. The sha256 of
    each image received is kept (`received`), and a short answer streams as a chat stream does,
    its usage counting the images' tokens in the prompt (`image_tokens` each)."""

    def __init__(self, model: str = "m", image_tokens: int = 64) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        self.model = model
        self.image_tokens = image_tokens
        self.received: list[str] = []

    def get(self, handler: _Handler) -> None:
        if handler.path == "/v1/models":
            handler._json(200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            handler._json(404, {"error": "not found"})

    def images_of(self, body: dict[str, Any]) -> tuple[list[bytes], str | None]:
        """The images a request carries, or why its shape is not OpenAI's."""
        import base64
        import binascii

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return [], "messages: a non-empty list"
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "user":
            return [], "messages[-1].role: user"
        parts = last.get("content")
        if not isinstance(parts, list):
            return [], "messages[-1].content: a list of parts"
        texts = [p for p in parts if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != 1 or not isinstance(texts[0].get("text"), str):
            return [], "messages[-1].content: one {type: text, text: <string>} part"
        images = []
        for index, part in enumerate(parts):
            if part in texts:
                continue
            url = (part.get("image_url") or {}).get("url") if isinstance(part, dict) else None
            if part.get("type") != "image_url" or not isinstance(url, str):
                return [], f"messages[-1].content[{index}]: {{type: image_url, image_url: {{url}}}}"
            head, _, data = url.partition(",")
            if not (head.startswith("data:image/") and head.endswith(";base64")):
                return [], f"messages[-1].content[{index}].image_url.url: data:image/...;base64,"
            try:
                images.append(base64.b64decode(data, validate=True))
            except binascii.Error:
                return [], f"messages[-1].content[{index}].image_url.url: not base64"
        if not images:
            return [], "messages[-1].content: at least one image_url part"
        return images, None

    def post(self, handler: _Handler, body: dict[str, Any]) -> None:
        import hashlib

        if handler.path != "/v1/chat/completions":
            handler._json(404, {"error": {"message": f"no route {handler.path}"}})
            return
        images, problem = self.images_of(body)
        if problem is not None:
            handler._json(400, {"error": {"message": problem, "type": "invalid_request_error"}})
            return
        self.received += [hashlib.sha256(image).hexdigest() for image in images]
        handler._start_chunked("text/event-stream")
        tokens = int(body.get("max_tokens", 4))
        for index in range(tokens):
            chunk = {"id": "x", "object": "chat.completion.chunk", "model": self.model,
                     "choices": [{"index": 0, "delta": {"content": f" red{index}"},
                                  "finish_reason": "length" if index == tokens - 1 else None}]}  # fmt: skip
            handler._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            time.sleep(0.001)
        prompt = 5 + self.image_tokens * len(images)
        usage = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                                          "total_tokens": prompt + tokens}}  # fmt: skip
        handler._chunk(f"data: {json.dumps(usage)}\n\n".encode())
        handler._chunk(b"data: [DONE]\n\n")
        handler._end_chunked()


@contextmanager
def serving(server: _Server) -> Iterator[str]:
    """Run the server in a thread; yields its base URL."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert isinstance(host, str)  # an IPv4 server: never bytes
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
