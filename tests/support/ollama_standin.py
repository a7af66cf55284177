"""A stand-in `ollama` executable for nodes of the tests: Ollama itself cannot run here (no
download of its binary or of any model is possible from this machine, and it needs real weights).

It follows Ollama's CLI and its HTTP API (docs/api.md, docs/faq.md) field by field, for what
the harness and a node's setup commands use:

- `ollama serve`: listens on `OLLAMA_HOST` (`host:port`; default 127.0.0.1:11434), keeps its
  models under `OLLAMA_MODELS` (default ~/.ollama/models), unloads an idle model after
  `OLLAMA_KEEP_ALIVE` (default 5m); writes its own log lines to stderr, as Ollama does.
- `ollama pull MODEL` (POST /api/pull on `OLLAMA_HOST`), printing the progress lines the real
  CLI prints (`pulling manifest`, `pulling <digest>... 100% 1.0 MB`, `verifying sha256 digest`,
  `writing manifest`, `success`); `ollama list` (GET /api/tags: NAME, ID, SIZE, MODIFIED);
  `ollama --version` (`ollama version is 0.12.3`).
- HTTP: GET /api/version {version}; GET /api/tags {models: [{name, model, modified_at, size,
  digest, details}]}; GET /api/ps {models: [{name, model, size, digest, details, expires_at,
  size_vram}]}; POST /api/show {model} -> {modelfile, parameters, template, details, model_info,
  capabilities}; POST /api/pull {model, stream} -> NDJSON {status}, {status: "pulling <digest>",
  digest, total, completed}, ..., {status: "success"}, or {error} for an unknown model;
  POST /api/chat (NDJSON chunks {model, created_at, message, done: false}, then the final chunk
  with done_reason, total_duration, load_duration, prompt_eval_count, prompt_eval_duration,
  eval_count, eval_duration, in nanoseconds); POST /api/generate with no prompt and
  keep_alive 0 unloads the model (done_reason "unload"). A chat with keep_alive 0 unloads the
  model once it has answered. A model that was not pulled answers 404
  {"error": "model 'x' not found"}.

Models: any name pulls, except one whose name starts with `missing` (`pull model manifest: file
does not exist`). A tag ending in `70b` weighs 170 GB (vram_check must refuse it on the stand-in
GPUs); any other 1 MB. Pulling takes `OLLAMA_STANDIN_PULL_S` seconds (default 0.5).
"""

from __future__ import annotations

import stat
from pathlib import Path

OLLAMA_VERSION = "0.12.3"

OLLAMA_SCRIPT = r'''#!/usr/bin/python3
"""Stand-in for ollama (tests/support/ollama_standin.py says what it follows)."""
import hashlib, json, os, sys, threading, time, urllib.error, urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = "%(version)s"


def host_port():
    value = os.environ.get("OLLAMA_HOST", "127.0.0.1:11434")
    value = value.split("://", 1)[-1]
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port or 11434)


def models_dir():
    return os.environ.get("OLLAMA_MODELS") or os.path.expanduser("~/.ollama/models")


def duration_s(text):
    text = str(text).strip()
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * units[unit]
    return float(text)


def full_name(name):
    return name if ":" in name else name + ":latest"


def now():
    return datetime.now(timezone.utc).isoformat()


def digest_of(name):
    return hashlib.sha256(name.encode()).hexdigest()


def size_of(name):
    return 170_000_000_000 if full_name(name).endswith("70b") else 1_000_000


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.loaded = None
        self.expires = 0.0
        self.keep_alive = duration_s(os.environ.get("OLLAMA_KEEP_ALIVE", "5m"))
        os.makedirs(models_dir(), exist_ok=True)
        self.registry = os.path.join(models_dir(), "standin-manifests.json")

    def pulled(self):
        try:
            with open(self.registry) as file:
                return json.load(file)
        except (OSError, ValueError):
            return {}

    def add(self, name):
        models = self.pulled()
        models[full_name(name)] = now()
        with open(self.registry, "w") as file:
            json.dump(models, file)

    def entry(self, name):
        name = full_name(name)
        return {"name": name, "model": name, "modified_at": self.pulled().get(name, now()),
                "size": size_of(name), "digest": digest_of(name),
                "details": {"parent_model": "", "format": "gguf", "family": "llama",
                            "families": ["llama"], "parameter_size": "0.1B",
                            "quantization_level": "Q8_0"}}

    def running(self):
        with self.lock:
            if self.loaded is not None and self.expires and time.time() > self.expires:
                self.loaded = None
            return self.loaded


STATE = None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        sys.stderr.write("[GIN] %%s | %%s\n" %% (now(), format %% args))

    def send_json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, body):
        data = json.dumps(body).encode() + b"\n"
        self.wfile.write(("%%x\r\n" %% len(data)).encode() + data + b"\r\n")
        self.wfile.flush()

    def end_stream(self):
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def body(self):
        length = int(self.headers.get("Content-Length", "0"))
        return json.loads(self.rfile.read(length) or b"{}")

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        if self.path == "/":
            data = b"Ollama is running"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/api/version":
            self.send_json(200, {"version": VERSION})
        elif self.path == "/api/tags":
            self.send_json(200, {"models": [STATE.entry(n) for n in sorted(STATE.pulled())]})
        elif self.path == "/api/ps":
            loaded = STATE.running()
            models = []
            if loaded is not None:
                entry = STATE.entry(loaded)
                expires = datetime.fromtimestamp(STATE.expires, timezone.utc).isoformat()
                models.append({**entry, "expires_at": expires, "size_vram": entry["size"]})
            self.send_json(200, {"models": models})
        else:
            self.send_json(404, {"error": "404 page not found"})

    def do_POST(self):
        body = self.body()
        name = body.get("model") or body.get("name") or ""
        if self.path == "/api/pull":
            return self.pull(name, body.get("stream", True))
        if full_name(name) not in STATE.pulled():
            return self.send_json(404, {"error": "model '%%s' not found" %% name})
        if self.path == "/api/show":
            entry = STATE.entry(name)
            return self.send_json(200, {
                "modelfile": "FROM " + name, "parameters": "", "template": "{{ .Prompt }}",
                "details": entry["details"],
                "model_info": {"general.architecture": "llama",
                               "general.parameter_count": size_of(name)},
                "capabilities": ["completion"]})
        if self.path == "/api/generate" and not body.get("prompt") and body.get("keep_alive") in (0, "0"):
            with STATE.lock:
                STATE.loaded = None
            return self.send_json(200, {"model": full_name(name), "created_at": now(),
                                        "response": "", "done": True, "done_reason": "unload"})
        if self.path == "/api/chat":
            return self.chat(name, body)
        self.send_json(404, {"error": "404 page not found"})

    def pull(self, name, stream):
        if name.startswith("missing"):
            return self.send_json(500, {"error": "pull model manifest: file does not exist"})
        total = size_of(name)
        seconds = float(os.environ.get("OLLAMA_STANDIN_PULL_S", "0.5"))
        digest = "sha256:" + digest_of(name)
        lines = [{"status": "pulling manifest"}]
        for step in range(1, 5):
            lines.append({"status": "pulling " + digest[7:19], "digest": digest,
                          "total": total, "completed": total * step // 4})
        lines += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"},
                  {"status": "success"}]
        if not stream:
            time.sleep(seconds)
            STATE.add(name)
            return self.send_json(200, {"status": "success"})
        self.start_stream()
        for line in lines:
            time.sleep(seconds / len(lines))
            if line["status"] == "success":
                STATE.add(name)
            self.chunk(line)
        self.end_stream()

    def chat(self, name, body):
        started = time.perf_counter_ns()
        load_ns = 0
        with STATE.lock:
            cold = STATE.loaded != full_name(name)
            STATE.loaded = full_name(name)
        if cold:
            time.sleep(0.05)
            load_ns = time.perf_counter_ns() - started
        count = int((body.get("options") or {}).get("num_predict", 8))
        self.start_stream()
        eval_start = time.perf_counter_ns()
        for index in range(count):
            time.sleep(0.002)
            self.chunk({"model": full_name(name), "created_at": now(),
                        "message": {"role": "assistant", "content": "tok%%d " %% index},
                        "done": False})
        eval_ns = time.perf_counter_ns() - eval_start
        keep = body.get("keep_alive", STATE.keep_alive)
        with STATE.lock:
            if keep in (0, "0"):
                STATE.loaded = None
            else:
                STATE.expires = time.time() + duration_s(keep)
        self.chunk({"model": full_name(name), "created_at": now(),
                    "message": {"role": "assistant", "content": ""}, "done": True,
                    "done_reason": "length", "total_duration": time.perf_counter_ns() - started,
                    "load_duration": load_ns, "prompt_eval_count": 5,
                    "prompt_eval_duration": 1_000_000, "eval_count": count,
                    "eval_duration": eval_ns})
        self.end_stream()


def serve():
    global STATE
    STATE = State()
    host, port = host_port()
    server = ThreadingHTTPServer((host, port), Handler)
    sys.stderr.write("time=%%s level=INFO source=routes.go msg=\"Listening on %%s:%%d (version %%s)\"\n"
                     %% (now(), host, port, VERSION))
    sys.stderr.flush()
    server.serve_forever()


def client(path, body=None):
    host, port = host_port()
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request("http://%%s:%%d%%s" %% (host, port, path), data=data,
                                     method="GET" if body is None else "POST")
    return urllib.request.urlopen(request, timeout=600)


def main(args):
    if args in (["--version"], ["-v"]):
        print("ollama version is " + VERSION)
        return 0
    if args == ["serve"]:
        serve()
        return 0
    if len(args) == 2 and args[0] == "pull":
        try:
            answer = client("/api/pull", {"model": args[1], "stream": True})
        except urllib.error.HTTPError as exc:
            print("Error: " + json.loads(exc.read()).get("error", ""), file=sys.stderr)
            return 1
        except OSError:
            print("Error: could not connect to ollama app, is it running?", file=sys.stderr)
            return 1
        for raw in answer:
            line = json.loads(raw)
            if "total" in line:
                print("{}... 100%% {:.1f} MB".format(line["status"], line["total"] / 1e6))
            else:
                print(line["status"])
        return 0
    if args in (["list"], ["ls"]):
        try:
            models = json.loads(client("/api/tags").read())["models"]
        except OSError:
            print("Error: could not connect to ollama app, is it running?", file=sys.stderr)
            return 1
        print("NAME\tID\tSIZE\tMODIFIED")
        for model in models:
            print("%%s\t%%s\t%%.1f MB\t%%s" %% (model["name"], model["digest"][:12],
                                              model["size"] / 1e6, model["modified_at"]))
        return 0
    print("Error: unknown command %%r for \"ollama\"" %% " ".join(args), file=sys.stderr)
    return 1


sys.exit(main(sys.argv[1:]))
'''


def write_ollama(directory: Path) -> Path:
    """Write the stand-in as `directory/ollama`, runnable by every user (an SSH test user
    too); put `directory` first on PATH to use it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ollama"
    path.write_text(OLLAMA_SCRIPT % {"version": OLLAMA_VERSION}, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH
               | stat.S_IXOTH)  # fmt: skip
    return path
