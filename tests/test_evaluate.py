"""`vismmoe-edge eval`: scoring on a hand-made mini set, user data checks, and the real command end to end."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.test_cli import assert_one_line_error, run_cli, run_cli_in_process
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.evaluation.routing_stats import top_share
from vismmoe_edge.evaluation.scoring import Scoreboard, normalize_answer
from vismmoe_edge.evaluation.vqa import VQAItem, evaluate, folder_items, shapes_vqa_items
from vismmoe_edge.experts.compute import ExpertRuntime


def test_normalize_answer() -> None:
    assert normalize_answer("The Red.") == "red"
    assert normalize_answer("  yes!\n") == "yes"
    assert normalize_answer("an owl") == "owl"
    assert normalize_answer("2") != normalize_answer("12")
    assert normalize_answer("red circle") != normalize_answer("red")


def test_scoreboard_by_hand() -> None:
    board = Scoreboard()
    for family, prediction, answer in [
        ("color", "red", "red"),
        ("color", "Blue.", "blue"),
        ("color", "green", "red"),
        ("count", "3", "3"),
        ("count", "three", "3"),  # exact match means exact: words are not numbers
    ]:
        board.add(family, prediction, answer)
    acc = board.accuracy()
    assert acc["color"] == pytest.approx(2 / 3)
    assert acc["count"] == pytest.approx(1 / 2)
    assert acc["overall"] == pytest.approx(3 / 5)
    assert board.counts() == {"color": 3, "count": 2, "overall": 5}


def test_top_share() -> None:
    uniform = torch.full((2, 8), 10)
    assert top_share(uniform).tolist() == pytest.approx([0.25, 0.25])
    skewed = torch.tensor([[97, 1, 1, 1, 0, 0, 0, 0]])
    assert top_share(skewed).item() == pytest.approx(0.98)


# --- evaluate() against a scripted engine: the answers are known, so the accuracy is known ------------------


@dataclass
class ScriptedEngine:
    """Just enough of Engine for evaluate(): it answers from a script and routes every token to expert 0."""

    script: dict[str, str]
    experts: ExpertRuntime = field(default_factory=lambda: ExpertRuntime(pipeline=None))
    catalogue: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(moe_layers=[0, 1], num_experts=4))
    compression: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(method="none"))
    model: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(config=SimpleNamespace(image_token_id=9)))

    def encode(self, question: str, images: list[Image.Image]) -> SimpleNamespace:
        assert len(images) == 1 and isinstance(images[0], Image.Image)
        return SimpleNamespace(question=question, input_ids=torch.tensor([[1, 9, 9, 9, 2]]))

    def generate_from_inputs(self, inputs: SimpleNamespace, sampling: object) -> SimpleNamespace:
        for layer in (0, 1):
            for hook in self.experts.route_hooks:
                hook(layer, None, torch.zeros(5, 2, dtype=torch.long), None)
        return SimpleNamespace(
            text=self.script[inputs.question],
            timings=SimpleNamespace(prefill_s=0.01),
            experts={"hits": 3.0, "misses": 1.0, "bytes_read": 100.0, "stall_s": 0.0},
            compression=None,
        )


def test_evaluate_on_a_hand_made_set() -> None:
    blank = Image.new("RGB", (64, 64))
    items = [
        VQAItem("1", "What colour is the circle?", "red", "color", render=lambda: blank),
        VQAItem("2", "What colour is the square?", "blue", "color", render=lambda: blank),
        VQAItem("3", "How many circles are there?", "2", "count", render=lambda: blank),
        VQAItem("4", "Is there a cat?", "no", "existence", render=lambda: blank),
    ]
    engine = ScriptedEngine(
        {
            "What colour is the circle?": "Red.",
            "What colour is the square?": "green",
            "How many circles are there?": "2",
            "Is there a cat?": "no",
        }
    )
    seen: list[dict] = []
    report = evaluate(engine, items, on_prediction=seen.append, progress=False)
    assert report.accuracy == {"color": 0.5, "count": 1.0, "existence": 1.0, "overall": 0.75}
    assert [r["correct"] for r in seen] == [True, False, True, True]
    assert report.routing["top25_share_mean"] == pytest.approx(1.0)  # every activation on one expert
    assert report.routing["activations"] == 4 * 2 * 10
    assert report.experts["hit_rate"] == pytest.approx(0.75)
    assert report.visual_tokens_mean == 3
    assert engine.experts.route_hooks == []  # the counter is removed afterwards
    # time per question, split into image + processor, prefill and decode
    assert report.prefill_ms_mean == pytest.approx(10.0) and report.decode_ms_mean == 0.0
    assert [r["prefill_ms"] for r in seen] == [10.0] * 4
    assert 0 <= report.prep_ms_mean and report.seconds_per_question == pytest.approx(report.seconds / 4)
    assert {"seconds_per_question", "prefill_ms_mean", "prep_ms_mean", "threads"} <= set(report.as_dict())


def test_choose_threads(monkeypatch) -> None:
    from vismmoe_edge.evaluation.vqa import choose_threads

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert choose_threads("auto", "cpu") == 2  # an idle machine: every core
    monkeypatch.setattr(os, "getloadavg", lambda: (1.1, 0.0, 0.0))
    assert choose_threads("auto", "cpu") == 1  # one core busy elsewhere: one thread, none waiting for it
    monkeypatch.setattr(os, "getloadavg", lambda: (4.5, 0.0, 0.0))
    assert choose_threads("auto", "cpu") == 1
    assert choose_threads("3", "cpu") == 3 and choose_threads("default", "cpu") is None
    with pytest.raises(VismmoeError, match="threads"):
        choose_threads("many", "cpu")


# --- user data ------------------------------------------------------------------------------------------------


def write_folder(root: Path, records: list[object]) -> Path:
    (root / "images").mkdir(parents=True)
    Image.new("RGB", (64, 64), (200, 10, 10)).save(root / "images" / "a.png")
    (root / "questions.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return root


def test_folder_items_reads_user_data(tmp_path: Path) -> None:
    root = write_folder(
        tmp_path / "d",
        [
            {"image": "images/a.png", "question": "What colour?", "answer": "red", "family": "color"},
            {"image": str(tmp_path / "d" / "images" / "a.png"), "question": "Shape?", "answer": "square", "id": "x"},
        ],
    )
    items = folder_items(root)
    assert [(i.id, i.family, i.answer) for i in items] == [("1", "color", "red"), ("x", "all", "square")]
    assert items[0].load().size == (64, 64)
    assert len(folder_items(root, limit=1)) == 1


@pytest.mark.parametrize(
    ("records", "needle"),
    [
        (["not an object"], "expected a JSON object"),
        ([{"image": "images/a.png", "question": "q"}], "'answer'"),
        ([{"image": "images/missing.png", "question": "q", "answer": "a"}], "not found"),
        ([], "no questions"),
    ],
)
def test_folder_items_rejects_bad_data(tmp_path: Path, records: list[object], needle: str) -> None:
    root = write_folder(tmp_path / "d", records)
    with pytest.raises(VismmoeError, match=needle) as info:
        folder_items(root)
    assert "\n" not in str(info.value)


def test_folder_items_names_the_bad_line(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "d", [{"image": "images/a.png", "question": "q", "answer": "a"}])
    with (root / "questions.jsonl").open("a") as f:
        f.write("{broken\n")
    with pytest.raises(VismmoeError, match=r"questions.jsonl:2: not valid JSON"):
        folder_items(root)


def test_shapes_vqa_items_are_the_split() -> None:
    from vismmoe_edge.evaluation import shapes_vqa as sv

    items = shapes_vqa_items("shifted", limit=3)
    reference = sv.generate_split("shifted", 3, sv.SPLITS["shifted"][0], shifted=True)
    assert [(i.id, i.question, i.answer) for i in items] == [(e.id, e.question, e.answer) for e in reference]
    assert items[0].load().size == (reference[0].scene.width, reference[0].scene.height)


# --- the command ----------------------------------------------------------------------------------------------


def test_eval_command_on_user_folder(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    root = write_folder(
        tmp_path / "d",
        [
            {"image": "images/a.png", "question": "What colour is it?", "answer": "red", "family": "color"},
            {"image": "images/a.png", "question": "Is it a square?", "answer": "yes", "family": "existence"},
        ],
    )
    preds = tmp_path / "preds.jsonl"
    proc = run_cli(
        "eval", "--data", str(root), "--model", str(checkpoints["v5"]), "--memory-budget", "25%",
        "--pinned-layers", "1", "--tier", "host", "--predictions", str(preds), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["counts"] == {"color": 1, "existence": 1, "overall": 2}
    lines = [json.loads(line) for line in preds.read_text().splitlines()]
    assert [line["question"] for line in lines] == ["What colour is it?", "Is it a square?"]
    for line in lines:  # the report's accuracy is the predictions' own exact-match verdicts
        assert line["correct"] == (normalize_answer(line["prediction"]) == normalize_answer(line["answer"]))
    assert report["accuracy"]["overall"] == sum(line["correct"] for line in lines) / 2
    assert len(report["routing"]["top25_share_per_layer"]) == 10
    assert report["experts"]["bytes_read"] > 0


def test_eval_command_errors(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("eval"), "--benchmark")
    # the same path as the subprocess above, in process (tests/test_cli.py, run_cli_in_process)
    assert_one_line_error(run_cli_in_process("eval", "--benchmark", "mmmu"), "unknown benchmark")
    assert_one_line_error(run_cli_in_process("eval", "--benchmark", "shapes-vqa", "--split", "bogus"), "unknown split")
    assert_one_line_error(run_cli_in_process("eval", "--data", str(tmp_path / "nope")), "not found")
