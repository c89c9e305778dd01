"""mini-swe-agent's environment for a gyre run: each command runs in the run's task
sandbox, through the run's gateway (`POST {GYRE_EXEC_URL}` with the run's key), never
in the scaffold's own process tree. Standard library (and mini-swe-agent) only: it is
imported by mini-swe-agent inside the scaffold's sandbox, where gyre is not installed.

Configured as `environment_class: gyre_env.GyreSandboxEnvironment` (the module is on
PYTHONPATH in the sandbox). The interface is mini-swe-agent's `LocalEnvironment`'s:
`execute(action, cwd, timeout) -> {"output", "returncode", "exception_info"}`, and the
same submission rule (a first output line COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT ends
the run).
"""

from __future__ import annotations

import json
import os
import platform
import urllib.error
import urllib.request
from typing import Any

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class GyreSandboxEnvironment:
    def __init__(self, *, cwd: str = "", timeout: int = 30, env: dict | None = None,
                 **_: Any):
        self.url = os.environ["GYRE_EXEC_URL"]
        self.key = os.environ["OPENAI_API_KEY"]
        self.config = {"cwd": cwd, "timeout": timeout, "env": env or {}}

    def _post(self, body: dict, timeout_s: float) -> dict:
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.key}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            return {"output": f"the sandbox refused the command: HTTP {exc.code}: {detail}",
                    "returncode": -1, "refused": True}

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None
                ) -> dict[str, Any]:
        command = action.get("command", "") if isinstance(action, dict) else str(action)
        res = self._post({"command": command}, (timeout or self.config["timeout"]) + 600)
        returncode = res.get("returncode")
        output = {"output": res.get("output", ""),
                  "returncode": -1 if returncode is None else returncode,
                  "exception_info": (f"the command exceeded the sandbox's {res['limit']} limit"
                                     if res.get("limit") else "")}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs) -> dict[str, Any]:
        # not os.environ (LocalEnvironment's choice): the run's key must not reach a prompt
        return {**self.config, **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config,
                                    "environment_type": "gyre_env.GyreSandboxEnvironment"}}}
