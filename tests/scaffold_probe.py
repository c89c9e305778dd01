"""A scaffold for the tests (standard library only): it does what a scaffold does (one
model call on OPENAI_BASE_URL with OPENAI_API_KEY, commands through GYRE_EXEC_URL),
then probes its sandbox the way a hostile one would, and writes what it found to
~/probe.json.

    PROBE_FILES     files it tries to read (the job secret, another run's home, ...)
    PROBE_TCP       host:port addresses it tries to connect to (engine, control, gateway)
    PROBE_COMMANDS  JSON list of commands to run through the sandbox
    PROBE_OTHER_RUN a run id whose URL it tries with its own key
"""

import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path


def post(url, body, key=None):
    key = key or os.environ["OPENAI_API_KEY"]
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}"


def main():
    base, out = os.environ["OPENAI_BASE_URL"], {}
    task = os.environ["GYRE_TASK"]
    out["task_file"] = (Path.home() / "TASK.md").read_text() == task
    out["chat"] = post(f"{base}/chat/completions", {
        "model": "gyre-policy", "max_tokens": 4,
        "messages": [{"role": "user", "content": task[:200]}]})[0]
    out["commands"] = [post(os.environ["GYRE_EXEC_URL"], {"command": c})[1]
                       for c in json.loads(os.environ.get("PROBE_COMMANDS", "[]"))]
    out["files"] = {}
    for path in filter(None, os.environ.get("PROBE_FILES", "").split(":")):
        try:
            out["files"][path] = Path(path).read_bytes()[:64].decode(errors="replace")
        except OSError as exc:
            out["files"][path] = f"refused: {type(exc).__name__}"
    out["tcp"] = {}
    for addr in filter(None, os.environ.get("PROBE_TCP", "").split(",")):
        host, port = addr.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            out["tcp"][addr] = "connected"
        except OSError as exc:
            out["tcp"][addr] = f"refused: {type(exc).__name__}"
    other = os.environ.get("PROBE_OTHER_RUN")
    if other:
        root = base.split("/runs/")[0]
        out["other_run"] = post(f"{root}/runs/{other}/v1/chat/completions", {
            "model": "gyre-policy", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2})[0]
    out["uid"] = os.getuid()
    out["env_keys"] = sorted(os.environ)
    (Path.home() / "probe.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
