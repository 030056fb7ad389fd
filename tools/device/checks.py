"""The device scripts' check runner: each check a named function returning a dict of what it measured (`ok`:
False marks a failure); results recorded as pass / fail / skipped with the seconds taken and printed one line
each. One failing check never stops the others: a device call is minutes of budget."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


class Checks:
    def __init__(self, quick: bool = False, *, needs_cuda: bool = True, only: str | None = None) -> None:
        self.results: list[dict[str, Any]] = []
        self.quick = quick
        self.cuda = torch.cuda.is_available() or not needs_cuda  # a CPU dry run runs the CUDA checks on the CPU
        self.only = only  # run only the checks whose name contains this

    def run(self, name: str, fn: Callable[[], dict[str, Any]], *, needs_cuda: bool = True) -> dict[str, Any]:
        if self.only is not None and self.only not in name:
            return {}
        if needs_cuda and not self.cuda:
            self.results.append({"name": name, "status": "skipped", "reason": "no CUDA device"})
            return self.results[-1]
        start = time.perf_counter()
        try:
            out = fn()
            status = "pass" if out.pop("ok", True) else "fail"
            self.results.append({"name": name, "status": status, **out})
        except Exception as e:  # noqa: BLE001 - one failing check must not stop the others
            self.results.append({"name": name, "status": "fail", "error": f"{type(e).__name__}: {e}",
                                 "trace": traceback.format_exc(limit=4)[-1200:]})  # fmt: skip
        r = self.results[-1]
        r["seconds"] = round(time.perf_counter() - start, 3)
        print(f"[{r['status']:4s}] {name}: " + json.dumps({k: v for k, v in r.items() if k not in ("name", "trace")}),
              flush=True)  # fmt: skip
        return r
