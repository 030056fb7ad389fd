"""The command line's findings of issue 14: prompts from files and stdin, the context check before prefill,
one-line range errors and malformed-checkpoint errors, non-finite logits, `info`/`plan` without a model, and a
SIGTERM while `serve` is still importing."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import run_cli_in_process
from vismmoe_edge.errors import VismmoeError

CLI = [sys.executable, "-m", "vismmoe_edge.cli"]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, input=stdin)


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def random_model() -> Path:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import ensure_random_demo_model

    return ensure_random_demo_model()


def test_prompt_from_a_file_and_from_stdin(random_model: Path, tmp_path: Path) -> None:
    prompt = "Describe the picture,\nline by line."  # two lines: more than one argument can comfortably carry
    (tmp_path / "p.txt").write_text(prompt)
    base = ["run", "--model", str(random_model), "--max-new-tokens", "2", "--json"]
    from_file = run_cli_in_process(*base, "--prompt-file", str(tmp_path / "p.txt"))  # a file: no process needed
    from_stdin = run_cli(*base, "--prompt-file", "-", stdin=prompt)  # standard input: a real process's
    for proc in (from_file, from_stdin):
        assert proc.returncode == 0, proc.stderr
    ids = [json.loads(p.stdout)["prompt_token_ids"] for p in (from_file, from_stdin)]
    assert ids[0] == ids[1]
    from vismmoe_edge.cli.run import read_prompt

    assert read_prompt(prompt, None) == read_prompt(None, tmp_path / "p.txt") == prompt
    start = time.monotonic()
    one_line_error(run_cli(*base), "--prompt")  # neither, both, a missing file: one line, before torch loads
    one_line_error(run_cli(*base, "--prompt", "x", "--prompt-file", "-"), "--prompt")
    one_line_error(run_cli(*base, "--prompt-file", str(tmp_path / "missing.txt")), "missing.txt")
    assert time.monotonic() - start < 30


def test_a_prompt_longer_than_the_context_is_refused_before_prefill(random_model: Path, tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text("word " * 30_000)  # ~30k tokens against a 4,096-token context
    start = time.monotonic()
    proc = run_cli("run", "--model", str(random_model), "--prompt-file", str(tmp_path / "long.txt"))
    seconds = time.monotonic() - start
    one_line_error(proc, "4096", "context")
    assert seconds < 60  # prefill of 30k tokens would take minutes here


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["run", "--prompt", "x", "--top-p", "2"], "--top-p"),
        (["run", "--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--max-queue", "0"], "--max-queue"),
        (["serve", "--max-image-bytes", "lots"], "--max-image-bytes"),
        (["serve", "--allowed-origin", "localhost:3000"], "--allowed-origin"),
        (["run", "--prompt", "x", "--no-such-option"], "--no-such-option"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_range_and_usage_errors_are_one_line(args: list[str], needle: str) -> None:
    proc = run_cli(*args, timeout=120)
    one_line_error(proc, needle)
    assert proc.returncode == 2


def corrupt(src: Path, dest: Path, name: str, text: str) -> Path:
    shutil.copytree(src, dest)
    (dest / name).write_text(text)
    return dest


MALFORMED = {
    "weight_map_int": ("model.safetensors.index.json", json.dumps({"weight_map": 5})),
    "weight_map_list": ("model.safetensors.index.json", json.dumps({"weight_map": ["a"]})),
    "weight_map_value": ("model.safetensors.index.json", json.dumps({"weight_map": {"x": 5}})),
    "weight_map_path": ("model.safetensors.index.json", json.dumps({"weight_map": {"x": "../../etc/passwd"}})),
    "index_not_object": ("model.safetensors.index.json", "[]"),
    "config_field": ("config.json", "REPLACE:num_experts=many"),
    "config_text_config": ("config.json", "REPLACE:text_config=7"),
    "generation_config_list": ("generation_config.json", "[1]"),
    "tokenizer": ("tokenizer.json", "{"),
    "tokenizer_config": ("tokenizer_config.json", "[]"),
    "processor_config": ("processor_config.json", '{"image_processor": 5}'),
    "chat_template": ("chat_template.jinja", "{% for %}"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_any_malformed_checkpoint_file_is_one_line(case: str, random_model: Path, tmp_path: Path) -> None:
    """In process, through the loader the commands use: a VismmoeError of one line, which the CLI prints as is."""
    from vismmoe_edge.options import LoadOptions, load_engine

    name, text = MALFORMED[case]
    if text.startswith("REPLACE:"):
        key, value = text.removeprefix("REPLACE:").split("=")
        config = json.loads((random_model / "config.json").read_text())
        if key == "text_config":
            config[key] = int(value)
        else:
            config["text_config"][key] = value
        text = json.dumps(config)
    model = corrupt(random_model, tmp_path / case, name, text)
    with pytest.raises(VismmoeError) as caught:
        load_engine(model, LoadOptions(device="cpu", memory_budget="100%", pinned_layers=0, tier="host"))
    message = str(caught.value)
    assert "\n" not in message and str(model) in message, message


def test_malformed_index_through_the_cli(random_model: Path, tmp_path: Path) -> None:
    model = corrupt(random_model, tmp_path / "m", "model.safetensors.index.json", json.dumps({"weight_map": 5}))
    one_line_error(run_cli("run", "--model", str(model), "--prompt", "hi"), "weight_map")
    one_line_error(run_cli_in_process("info", str(model)), "weight_map")  # the same reader, after `run`'s subprocess


def poison_experts(src: Path, dest: Path, layer: int) -> Path:
    """A copy whose routed experts of one decoder layer are all NaN (bf16 0x7fc0)."""
    from vismmoe_edge.checkpoint import read_tensor_table

    shutil.copytree(src, dest)
    for name, info in read_tensor_table(dest).items():
        if f"layers.{layer}.mlp.experts." in name:
            with open(info.shard, "r+b") as f:
                f.seek(info.offset)
                f.write(b"\xc0\x7f" * (info.nbytes // 2))
    return dest


def test_non_finite_logits_stop_the_run_naming_step_and_layer(random_model: Path, tmp_path: Path) -> None:
    model = poison_experts(random_model, tmp_path / "nan", layer=3)
    proc = run_cli("run", "--model", str(model), "--prompt", "Hello", "--tier", "host", "--pinned-layers", "0")
    line = one_line_error(proc, "non-finite logits at prefill", "decoder layer 3")
    assert "NaN" in line


def test_non_finite_logits_in_decode_name_the_decode_step(random_model: Path) -> None:
    """In process: NaN appears only from the third decode step on; the step and the layer are named."""
    import torch

    from vismmoe_edge.options import LoadOptions, load_engine
    from vismmoe_edge.sampling import SamplingConfig

    engine, _ = load_engine(random_model, LoadOptions(device="cpu", memory_budget="100%", pinned_layers=0, tier="host"))
    calls = {"n": 0}
    layer = engine.language_model.layers[2]

    def poison(module: object, args: object, output: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return output * math.nan if calls["n"] >= 4 else output  # prefill is call 1, decode steps 2, 3, 4...

    handle = layer.register_forward_hook(poison)
    try:
        with pytest.raises(VismmoeError, match=r"decode step 3: .*decoder layer 2"):
            engine.generate("Hello", sampling=SamplingConfig(max_new_tokens=10, min_new_tokens=10))
    finally:
        handle.remove()


@pytest.mark.parametrize("command", ["info", "plan"])
def test_info_and_plan_default_to_the_demo_model(command: str) -> None:
    proc = run_cli_in_process(command)  # argument handling: both commands run as subprocesses in other tests
    assert proc.returncode == 0, proc.stderr
    assert "demo_model" in proc.stdout and "demo model" in proc.stderr


def catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3, 0.8, 1.5])
def test_sigterm_while_serve_is_still_importing_exits_0(delay: float, tmp_path: Path) -> None:
    """systemd may stop the unit at any moment of its start; the old daemon died of the signal (143) here."""
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ}
    )
    # No program catches a signal before its interpreter runs: count the delay from the handler's arrival
    # (SigCgt in /proc), so a slow start on a loaded machine does not turn into a kill before Python is up.
    deadline = time.monotonic() + 30
    while not catches_sigterm(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, (proc.returncode, out.decode()[-2000:])
    assert b"Traceback" not in out
