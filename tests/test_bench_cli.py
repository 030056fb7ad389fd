"""`vismmoe-edge bench`: a real run on a small checkpoint, with the oracle as a sanity bound."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from vismmoe_edge.cli import app


def test_bench_json_reports_medians_and_the_oracle(checkpoints, images) -> None:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--model",
            str(checkpoints["v5"]),
            "--image",
            str(images[0]),
            "--memory-budget",
            "20%",
            "--tokens",
            "4",
            "--repeats",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert len(summary["trials"]) == 2
    median = summary["median"]
    assert median["decode_tokens_per_s"] > 0 and median["prefill_s"] > 0
    for trial in summary["trials"]:
        # LRU can never move fewer bytes than Belady's optimum for the same routing and slot count
        assert trial["decode_bytes_per_token"] >= trial["oracle_bytes_per_token"]
    assert summary["options"]["routing"].startswith("sampled")


def test_bench_rejects_bad_options(checkpoints) -> None:
    result = CliRunner().invoke(app, ["bench", "--model", str(checkpoints["v5"]), "--tier", "warp"])
    assert result.exit_code == 2
    assert "--tier 'warp'" in result.output
