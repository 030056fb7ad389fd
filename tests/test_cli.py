"""The command line as a user meets it: real subprocesses, one-line errors, JSON output equal to transformers.

Calls down a path a subprocess here already took (a second bad image or bad option of `run`, the text form of
`info`, a model directory refused one check after a missing one) run the CLI's main() in process instead
(run_cli_in_process): the same argv and assertions without an interpreter's start and imports."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
import torch

CLI = [sys.executable, "-m", "vismmoe_edge.cli"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def run_cli_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`main()`, the function `python -m vismmoe_edge.cli` calls, in this process: the same parsing, command and error
    printing without the interpreter's start and its imports (~6 s a call here). For variants of an error whose
    path a real subprocess already covers; an exception that escapes `main()` fails the test, as a traceback would."""
    from vismmoe_edge.cli import main

    out, err = io.StringIO(), io.StringIO()
    code, threads = 0, torch.get_num_threads()  # a command may set the thread count: not for the tests after it
    with mock.patch.object(sys, "argv", ["vismmoe-edge", *args]), redirect_stdout(out), redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1  # as the interpreter maps it
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess([*CLI, *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def broken_models(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    index = json.loads((checkpoints["v5"] / "model.safetensors.index.json").read_text())["weight_map"]
    shard_name = index["model.language_model.layers.3.mlp.experts.gate_up_proj"]

    corrupt = shutil.copytree(checkpoints["v5"], root / "corrupt")
    data = bytearray((corrupt / shard_name).read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header becomes garbage
    (corrupt / shard_name).write_bytes(bytes(data))

    truncated = shutil.copytree(checkpoints["v5"], root / "truncated")
    (truncated / shard_name).write_bytes((truncated / shard_name).read_bytes()[:-4096])

    unsupported = root / "llama"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))

    not_a_model = root / "photos"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("hello")

    not_an_image = root / "fake.png"
    not_an_image.write_text("this is text, not a PNG")
    return {
        "corrupt": corrupt,
        "truncated": truncated,
        "unsupported": unsupported,
        "not_a_model": not_a_model,
        "not_an_image": not_an_image,
        "shard": Path(shard_name),
    }


def test_missing_directory() -> None:
    assert_one_line_error(run_cli("run", "--model", "/nonexistent/model", "--prompt", "hi"), "/nonexistent/model")


def test_not_a_model_directory(broken_models) -> None:
    proc = run_cli_in_process("run", "--model", str(broken_models["not_a_model"]), "--prompt", "hi")
    assert_one_line_error(proc, "config.json")  # the path of test_missing_directory's subprocess, one check later


def test_corrupt_shard(broken_models) -> None:
    proc = run_cli("run", "--model", str(broken_models["corrupt"]), "--prompt", "hi")
    assert_one_line_error(proc, broken_models["shard"].name, "corrupt")


def test_truncated_shard(broken_models) -> None:
    proc = run_cli("info", str(broken_models["truncated"]))
    assert_one_line_error(proc, broken_models["shard"].name, "truncated", "layers.3.mlp.experts.gate_up_proj")


def test_unsupported_architecture(broken_models) -> None:
    proc = run_cli_in_process("run", "--model", str(broken_models["unsupported"]), "--prompt", "hi")  # as above
    assert_one_line_error(proc, "unsupported architecture LlamaForCausalLM")


def test_bad_images(checkpoints, broken_models) -> None:
    model = str(checkpoints["v5"])
    proc = run_cli("run", "--model", model, "--prompt", "hi", "--image", str(broken_models["not_an_image"]))
    assert_one_line_error(proc, "fake.png", "not an image")
    proc = run_cli_in_process("run", "--model", model, "--prompt", "hi", "--image", "/nonexistent/cat.jpg")
    assert_one_line_error(proc, "/nonexistent/cat.jpg", "not found")


def test_empty_prompt_and_bad_budget(checkpoints) -> None:
    assert_one_line_error(run_cli("run", "--model", str(checkpoints["v5"]), "--prompt", "  "), "prompt is empty")
    proc = run_cli_in_process("run", "--model", str(checkpoints["v5"]), "--prompt", "hi", "--memory-budget", "lots")
    assert_one_line_error(proc, "memory budget 'lots'")


def test_info_reports_sizes(checkpoints) -> None:
    proc = run_cli("info", str(checkpoints["hub"]), "--memory-budget", "40%", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["expert_layout"] == "hub"
    assert (info["moe_layers"], info["experts_per_layer"], info["top_k"]) == (10, 16, 4)
    assert info["bytes_per_expert"] == 3 * 48 * 128 * 4
    assert info["total_expert_bytes"] == 10 * 16 * info["bytes_per_expert"]
    depths = [fit["pinned_layers"] for fit in info["pinned_depths_that_fit"]]
    assert depths == [0, 1, 2, 3]  # 4 layers = 40% leaves no room for a streamed expert
    text = run_cli_in_process("info", str(checkpoints["hub"]), "--memory-budget", "40%").stdout
    assert "0..3 layers fit" in text


def test_json_run_equals_transformers_generate(tmp_path: Path, images) -> None:
    """A checkpoint written by transformers' save_pretrained, with its processor beside it."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_offline_processor, tiny_config

    processor = build_offline_processor(min_pixels=4096, max_pixels=32 * 32 * 48)
    config = tiny_config(tokenizer=processor.tokenizer, num_layers=3, num_experts=20, top_k=3, moe_intermediate=40)
    torch.manual_seed(11)
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(10)  # lets greedy tokens vary on random weights
    model.generation_config.eos_token_id = [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.save_pretrained(tmp_path / "m", max_shard_size="300KB")
    processor.save_pretrained(tmp_path / "m")

    proc = run_cli(
        "run",
        "--model",
        str(tmp_path / "m"),
        "--image",
        str(images[0]),
        "--prompt",
        "Describe it.",
        "--max-new-tokens",
        "10",
        "--memory-budget",
        "50%",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"prompt_token_ids", "token_ids", "text", "timings", "experts"}
    assert out["experts"]["misses"] > 0

    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(images[0]).convert("RGB")], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == out["prompt_token_ids"]
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "m", experts_implementation="eager")
    with torch.no_grad():
        ref = reloaded.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert out["token_ids"] == ref[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(out["token_ids"]) > 1
